"""The Engine's train step now vs at an earlier commit: a paired, same-run comparison.

Restructuring the step (its seams, DESIGN section 7) must not slow it down. This checks out
``--before`` (default: b2797e3, the step as issue [2/5] left it, before the seams) into a temporary
directory and starts two long-lived worker processes -- one importing that tree's ``titanax``, one
this checkout's -- each building the same GPT engine (``benchmarks/step_speed.py``'s cells: same
model, mesh, batch and optimizer) and compiling its step. Then, in rounds whose order alternates,
each worker times ``--steps`` steps while the other waits idle; the figure is the median over
rounds of the paired ratio after / before, so the machine's drift cancels.

    python benchmarks/before_after.py                      # 4x2 and 8x1, K=1 and 4, f32
    python benchmarks/before_after.py --before <rev> --cells "small 4x2 K=1 f32"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CELLS = ["small 4x2 K=1 f32", "small 4x2 K=4 f32", "small 8x1 K=1 f32",
                 "small 8x1 K=4 f32"]


def _worker(tree: str, label: str) -> None:
    """Builds the cell's engine from ``tree``'s code; then times steps on request (stdin)."""
    sys.path.insert(0, tree)
    import importlib.util  # pylint: disable=import-outside-toplevel
    from titanax.runtime.cpu_devices import simulate_cpu_devices  # pylint: disable=import-outside-toplevel
    simulate_cpu_devices(8)
    import time  # pylint: disable=import-outside-toplevel

    import titanax  # pylint: disable=import-outside-toplevel
    assert os.path.dirname(os.path.dirname(os.path.abspath(titanax.__file__))) == tree, \
        f"imported titanax from {titanax.__file__}, not {tree}"
    spec = importlib.util.spec_from_file_location(
        "step_speed_of_tree", os.path.join(tree, "benchmarks", "step_speed.py"))
    step_speed = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = step_speed  # Its dataclasses look their module up.
    spec.loader.exec_module(step_speed)
    from tests.train.helpers import text_batches  # pylint: disable=import-outside-toplevel
    shape, mesh, accumulate, dtype = label.split()
    data, model = (int(x) for x in mesh.split("x"))
    cell = step_speed.Cell(shape, data, model, int(accumulate.split("=")[1]), dtype)
    sizes = step_speed.SHAPES[shape]
    batch = text_batches(batch_size=sizes["batch_size"], seq_len=sizes["seq_len"], count=1)[0]
    _, runner = step_speed._titanax_runner(cell, batch, unroll=None, name="titanax")  # pylint: disable=protected-access
    print(json.dumps({"ready": True, "first_loss": runner.first_loss}), flush=True)
    for line in sys.stdin:
        steps = int(line)
        runner.block()
        started = time.perf_counter()
        for _ in range(steps):
            runner.step()
        runner.block()
        print(json.dumps({"seconds_per_step": (time.perf_counter() - started) / steps}),
              flush=True)


def _start(tree: str, label: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=tree)
    process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", tree,
                                "--cells", label], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, cwd=tree, env=env)
    process.first_loss = _reply(process)["first_loss"]
    return process


def _reply(process: subprocess.Popen) -> Dict:
    """The worker's next JSON line (anything else it prints is passed through)."""
    for line in process.stdout:
        if line.startswith("{"):
            return json.loads(line)
        print(f"  worker: {line.rstrip()}", flush=True)
    raise RuntimeError(f"the worker for {process.args[-1]!r} exited with {process.wait()}")


def _time(process: subprocess.Popen, steps: int) -> float:
    process.stdin.write(f"{steps}\n")
    process.stdin.flush()
    return _reply(process)["seconds_per_step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="b2797e3")
    parser.add_argument("--cells", default=",".join(DEFAULT_CELLS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.cells)
        return
    with tempfile.TemporaryDirectory(prefix="titanax-before-") as before_tree:
        archive = subprocess.run(["git", "archive", args.before], cwd=REPO_ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", before_tree], input=archive, check=True)
        print(f"before: {args.before}; after: this checkout; {args.rounds} rounds of "
              f"{args.steps} steps, order alternating\n")
        print("cell               | before ms | after ms | after/before (paired median) | "
              "first losses: relative difference")
        results: List[Dict] = []
        for label in args.cells.split(","):
            label = label.strip()
            workers = {"before": _start(before_tree, label), "after": _start(REPO_ROOT, label)}
            times = {name: [] for name in workers}
            for round_index in range(args.rounds):
                order = ["before", "after"] if round_index % 2 == 0 else ["after", "before"]
                for name in order:
                    times[name].append(_time(workers[name], args.steps))
            for process in workers.values():
                process.stdin.close()
                process.wait()
            ratio = statistics.median(a / b for a, b in zip(times["after"], times["before"]))
            # The same program computes the same first loss; a reordered float32 sum (another
            # fusion, another attention formula) moves it by ~1e-7 of itself, a defect by far more.
            before_loss, after_loss = workers["before"].first_loss, workers["after"].first_loss
            difference = abs(before_loss - after_loss) / max(abs(before_loss), 1e-30)
            results.append({"cell": label, "ratio": ratio})
            print(f"{label:18s} | {1e3 * statistics.median(times['before']):9.1f} | "
                  f"{1e3 * statistics.median(times['after']):8.1f} | {ratio:28.3f} | {difference:.1e} "
                  f"({before_loss:.6f} vs {after_loss:.6f})",
                  flush=True)
        worst = max(r["ratio"] for r in results)
        print(f"\nworst after/before: {worst:.3f}")


if __name__ == "__main__":
    main()
