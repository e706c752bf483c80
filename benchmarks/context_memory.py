"""Context parallelism's memory: the compiled train step's temp bytes per device, by strategy.

For sequence lengths S = 1k .. 32k and context sizes CP = 1, 2, 4, 8 (a ``data x context = 1 x
CP`` mesh of simulated CPU devices), the train step of a small decoder (2 layers, 256 wide, 8
heads) on one row is compiled -- not run -- and XLA's memory analysis read: temp bytes per
device, the activations and attention buffers that context parallelism exists to cut. CP = 1 is
the same model without context parallelism. Compiling only, nothing is timed: the numbers are
XLA:CPU's buffer assignment (a GPU compiler fuses attention differently; the trend is what
carries over).

    python benchmarks/context_memory.py [--lengths=1024,4096] [--sizes=1,2,4,8]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from titanax.config import config_for_function  # noqa: E402
from titanax.modules.models.decoder import Decoder  # noqa: E402
from titanax.parallel.context_parallel import CP  # noqa: E402
from titanax.parallel.plan import DP, Plan  # noqa: E402
from titanax.runtime.mesh import MeshSpec  # noqa: E402
from titanax.train import optimizers  # noqa: E402
from titanax.train.engine import Engine  # noqa: E402
from titanax.train.learner import Learner  # noqa: E402

STRATEGIES = ("all_gather", "ring", "ulysses")


def temp_bytes(length: int, size: int, strategy: str) -> int:
    """The compiled train step's temp bytes per device."""
    axes, shape = (("data", "context"), (1, size)) if size > 1 else (("data",), (1,))
    plan = Plan.default_config().set(data_parallel=DP.default_config())
    if size > 1:
        plan.context_parallel = CP.default_config().set(strategy=strategy)
    cfg = Engine.default_config().set(
        mesh=MeshSpec.default_config().set(axes=axes, shape=shape, devices=list(range(size))),
        plan=plan,
        model=Decoder.default_config().set(name="llama", vocab_size=256, max_seq_len=length,
                                           num_layers=2, model_dim=256, num_heads=8,
                                           num_kv_heads=8, hidden_dim=512, unroll_layers=False),
        learner=Learner.default_config().set(optimizer=config_for_function(optimizers.sgd).set(
            learning_rate=0.1)),
        loggers=[], log_every=1000)
    engine = cfg.instantiate()
    engine.init_state()
    ids = np.random.default_rng(0).integers(0, 256, size=(1, length + 1), dtype=np.int32)
    batch = {"input_ids": ids[:, :-1], "target_ids": ids[:, 1:]}
    compiled = engine.compile(example_batch=batch).latest
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--sizes", default="1,2,4,8")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    sizes = [int(x) for x in args.sizes.split(",")]
    print("temp MiB per device of the compiled train step (XLA:CPU buffer assignment)")
    print(f"{'S':>6} {'CP':>3} " + " ".join(f"{s:>11}" for s in STRATEGIES)
          + "   ring / CP=1")
    for length in lengths:
        base = None
        for size in sizes:
            row = {}
            for strategy in STRATEGIES if size > 1 else STRATEGIES[:1]:
                row[strategy] = temp_bytes(length, size, strategy) / 2 ** 20
            if size == 1:
                base = row["all_gather"]
                row = {s: base for s in STRATEGIES}
            ratio = f"{row['ring'] / base:.3f}" if base else ""
            print(f"{length:>6} {size:>3} " + " ".join(f"{row[s]:>11.1f}" for s in STRATEGIES)
                  + f"   {ratio}", flush=True)


if __name__ == "__main__":
    main()
