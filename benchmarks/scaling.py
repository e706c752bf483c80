"""The seed's benchmark suites (section 8.3): throughput vs device count, compile vs run time, the
effect of accumulate_steps, and DP vs TP, for the Engine's GPT train step.

    python benchmarks/scaling.py                      # CPU: the tiny GPT on 8 simulated devices
    python benchmarks/scaling.py --shape gpt_small --cpu_devices 0   # a GPU node, GPT-2 small

Writes ``scaling.json`` and four plots (``scaling_devices.png``, ``scaling_compile.png``,
``scaling_accumulate.png``, ``scaling_dp_tp.png``) into ``--out`` (default docs/images, where
docs/performance.md shows them).

On a CPU the simulated devices share the machine's cores, so adding devices adds no compute:
the curves measure what the framework and XLA's partitioning cost as the mesh grows, not
hardware scaling. Run the same command on a GPU node for real scaling.

* strong scaling: a fixed global batch split over 1, 2, 4, 8 devices (data parallel);
* weak scaling: a fixed per-device batch, so the global batch grows with the devices;
* compile vs run: the train step's compile seconds next to its step time, per configuration;
* accumulate_steps: a fixed global batch in 1, 2, 4, 8 microbatches (temp memory falls);
* DP vs TP: the same 8 devices as data x model = 8x1, 4x2, 2x4 (and 1x8 where the heads split).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

SHAPES = {
    "tiny": dict(num_layers=4, model_dim=128, num_heads=4, vocab_size=256, seq_len=64,
                 per_device_batch=4, dtype="f32"),
    "gpt_small": dict(num_layers=12, model_dim=768, num_heads=12, vocab_size=50304,
                      seq_len=1024, per_device_batch=8, dtype="bf16"),
}


def _measure(shape: Dict[str, Any], *, data: int, model: int, batch: int, accumulate: int,
             steps: int) -> Dict[str, float]:
    import jax
    import numpy as np
    from titanax.config import config_for_function
    from titanax.modules.models.decoder import gpt_config
    from titanax.observe import memory
    from titanax.parallel.plan import DP, TP, Plan
    from titanax.runtime.mesh import MeshSpec
    from titanax.train import optimizers
    from titanax.train.engine import Engine
    from titanax.train.learner import Learner
    from titanax.train.precision import Precision

    tp = model > 1
    engine = Engine.default_config().set(
        mesh=MeshSpec.default_config().set(
            axes=("data", "model") if tp else ("data",),
            shape=(data, model) if tp else (data,), devices=list(range(data * model))),
        plan=Plan.default_config().set(
            data_parallel=DP.default_config().set(accumulate_steps=accumulate),
            tensor_parallel=TP.default_config() if tp else None),
        model=gpt_config().set(
            name="gpt", vocab_size=shape["vocab_size"], max_seq_len=shape["seq_len"],
            num_layers=shape["num_layers"], model_dim=shape["model_dim"],
            num_heads=shape["num_heads"]),
        learner=Learner.default_config().set(optimizer=config_for_function(optimizers.adamw).set(
            learning_rate=1e-4)),
        precision=Precision.default_config().set(bfloat16=shape["dtype"] == "bf16",
                                                 enable_x32_params=True),
        loggers=[]).instantiate()
    engine.init_state()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, min(shape["vocab_size"], 256), (batch, shape["seq_len"] + 1))
    host = {"input_ids": ids[:, :-1].astype(np.int32), "target_ids": ids[:, 1:].astype(np.int32)}
    placed = engine.global_batch(host)
    started = time.perf_counter()
    step = engine.compile(example_batch=placed)
    compile_s = time.perf_counter() - started
    engine.state, _ = step(engine.state, placed)
    times = []
    for _ in range(steps):
        jax.block_until_ready(engine.state)
        started = time.perf_counter()
        engine.state, _ = step(engine.state, placed)
        jax.block_until_ready(engine.state)
        times.append(time.perf_counter() - started)
    step_s = statistics.median(times)
    analysis = step.latest.memory_analysis()
    return {"data": data, "model": model, "batch": batch, "accumulate": accumulate,
            "compile_s": compile_s, "step_s": step_s,
            "tokens_per_s": batch * shape["seq_len"] / step_s,
            "temp_mib": (analysis.temp_size_in_bytes / 2 ** 20) if analysis else None,
            "step_mib": (memory.compiled_step_bytes(step.latest) or 0) / 2 ** 20}


def _plot(results: Dict[str, List[Dict[str, float]]], out: str, title: str) -> List[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(figure, name):
        path = os.path.join(out, name)
        figure.tight_layout()
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)

    figure, axis = plt.subplots(figsize=(5.5, 3.6))
    for kind in ("strong", "weak"):
        rows = results[kind]
        axis.plot([r["data"] for r in rows], [r["tokens_per_s"] for r in rows], "o-",
                  label=f"{kind} scaling")
    axis.set_xlabel("devices (data parallel)")
    axis.set_ylabel("tokens / s")
    axis.set_xticks([1, 2, 4, 8])
    axis.set_title(f"Throughput vs devices ({title})", fontsize=9)
    axis.legend(fontsize=8)
    save(figure, "scaling_devices.png")

    figure, axis = plt.subplots(figsize=(6.5, 3.6))
    rows = results["strong"] + results["dp_tp"] + results["accumulate"]
    labels = [f"{r['data']}x{r['model']} K={r['accumulate']}" for r in rows]
    xs = range(len(rows))
    axis.bar([x - 0.2 for x in xs], [r["compile_s"] for r in rows], 0.4, label="compile s")
    axis.bar([x + 0.2 for x in xs], [r["step_s"] * 10 for r in rows], 0.4,
             label="step s x 10")
    axis.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=7)
    axis.set_title(f"Compile time vs run time ({title})", fontsize=9)
    axis.legend(fontsize=8)
    save(figure, "scaling_compile.png")

    figure, axis = plt.subplots(figsize=(5.5, 3.6))
    rows = results["accumulate"]
    axis.plot([r["accumulate"] for r in rows], [r["tokens_per_s"] for r in rows], "o-",
              label="tokens / s")
    axis.set_xlabel("accumulate_steps (fixed global batch)")
    axis.set_ylabel("tokens / s")
    second = axis.twinx()
    second.plot([r["accumulate"] for r in rows], [r["temp_mib"] for r in rows], "s--",
                color="tab:red", label="temp MiB")
    second.set_ylabel("compiled step temp MiB")
    axis.set_title(f"Effect of accumulate_steps ({title})", fontsize=9)
    save(figure, "scaling_accumulate.png")

    figure, axis = plt.subplots(figsize=(5.5, 3.6))
    rows = results["dp_tp"]
    axis.bar([f"{r['data']}x{r['model']}" for r in rows], [r["tokens_per_s"] for r in rows])
    axis.set_xlabel("data x model (8 devices)")
    axis.set_ylabel("tokens / s")
    axis.set_title(f"DP vs TP ({title})", fontsize=9)
    save(figure, "scaling_dp_tp.png")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cpu_devices", type=int, default=8,
                        help="simulate this many CPU devices; 0: use the machine's accelerators")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "docs", "images"))
    args = parser.parse_args()
    from titanax.runtime.cpu_devices import simulate_cpu_devices
    if args.cpu_devices:
        simulate_cpu_devices(args.cpu_devices)
    import jax

    shape = SHAPES[args.shape]
    per_device = shape["per_device_batch"]
    devices = [d for d in (1, 2, 4, 8) if d <= jax.device_count()]
    fixed_batch = per_device * devices[-1]
    measure = lambda **kw: _measure(shape, steps=args.steps, **kw)  # noqa: E731
    results: Dict[str, List[Dict[str, float]]] = {
        "strong": [measure(data=d, model=1, batch=fixed_batch, accumulate=1) for d in devices],
        "weak": [measure(data=d, model=1, batch=per_device * d, accumulate=1) for d in devices],
        "accumulate": [measure(data=devices[-1], model=1, batch=fixed_batch * 2, accumulate=k)
                       for k in (1, 2, 4, 8)],
        "dp_tp": [measure(data=devices[-1] // m, model=m, batch=fixed_batch, accumulate=1)
                  for m in (1, 2, 4, 8) if m <= devices[-1] and shape["num_heads"] % m == 0],
    }
    os.makedirs(args.out, exist_ok=True)
    platform = jax.devices()[0].platform
    title = f"{args.shape} GPT, {jax.device_count()} {platform} devices"
    with open(os.path.join(args.out, "scaling.json"), "w", encoding="utf-8") as f:
        json.dump({"shape": args.shape, "platform": platform, "results": results}, f, indent=1)
    for kind, rows in results.items():
        print(f"{kind}:")
        for r in rows:
            print(f"  data {r['data']} x model {r['model']}  batch {r['batch']:4d}  "
                  f"K {r['accumulate']}  compile {r['compile_s']:6.2f}s  step "
                  f"{1e3 * r['step_s']:8.1f}ms  {r['tokens_per_s']:10.0f} tok/s  temp "
                  f"{r['temp_mib']:.1f} MiB")
    for path in _plot(results, args.out, title):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
