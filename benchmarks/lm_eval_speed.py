"""Requests per second of lm-eval's ``loglikelihood``: Titanax's ``TitanaxLM`` vs lm-eval's own
``hf`` backend, on the same model directory and requests, side by side in one run.

    python benchmarks/lm_eval_speed.py                       # the tiny chat model, 8 CPU devices
    python benchmarks/lm_eval_speed.py --hf=<dir> --requests=2000 --batch_size=32

The requests are multiple-choice continuations (a question, four answers each) like a
benchmark's; each backend scores them all once to warm up (Titanax compiles a program per
bucket length), then in ``--rounds`` alternating rounds; the figure is the median rate of each
and their ratio. Both read the same token ids (tests/harness/test_lm_eval_parity.py).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Request:
    """What lm-eval hands a model: ``args`` = (context, continuation)."""

    def __init__(self, context: str, continuation: str):
        self.args = (context, continuation)


def _requests(count: int, seed: int = 0):
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        context = f"Question: what is {a} plus {b}? Think of the sum of the two numbers.\nAnswer:"
        for answer in (a + b, a + b + 1, a * b, abs(a - b)):
            out.append(_Request(context, f" {answer}"))
    return out[:count]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", default=None, help="HF model dir (default: the tiny chat model)")
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu_devices", type=int, default=8)
    args = parser.parse_args()
    from titanax.runtime import cpu_devices
    cpu_devices.simulate_cpu_devices(args.cpu_devices)
    directory = args.hf
    if directory is None:
        sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
        import tiny_chat_model  # pylint: disable=import-outside-toplevel
        directory = tiny_chat_model.write(tempfile.mkdtemp())["model"]
    from lm_eval.models.huggingface import HFLM
    from titanax.harness.lm import TitanaxLM
    from titanax.train import saved_run
    engine, source, _ = saved_run.inference_engine(hf=directory, trainer_dir=None)
    from transformers import AutoTokenizer
    ours = TitanaxLM(engine=engine, tokenizer=AutoTokenizer.from_pretrained(source),
                     batch_size=args.batch_size)
    theirs = HFLM(pretrained=directory, dtype="float32", device="cpu",
                  batch_size=args.batch_size)
    requests = _requests(args.requests)
    backends = {"titanax": ours, "lm-eval hf": theirs}
    for lm in backends.values():  # Warm-up (compiles, caches).
        lm.loglikelihood(requests, disable_tqdm=True)
    rates = {name: [] for name in backends}
    for round_index in range(args.rounds):
        order = list(backends) if round_index % 2 == 0 else list(reversed(backends))
        for name in order:
            started = time.perf_counter()
            backends[name].loglikelihood(requests, disable_tqdm=True)
            rates[name].append(len(requests) / (time.perf_counter() - started))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    print(f"loglikelihood, {len(requests)} requests, batch {args.batch_size}, "
          f"{engine.mesh.devices.size} device(s) for titanax:")
    for name, value in medians.items():
        print(f"  {name:>11}: {value:8.1f} requests/s  (rounds: "
              + ", ".join(f"{v:.1f}" for v in rates[name]) + ")")
    print(f"  titanax / lm-eval hf: {medians['titanax'] / medians['lm-eval hf']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
