"""Pipeline memory from the compiled train step: 1F1B flat in M, GPipe growing with it.

For a GPT (4 layers, width 128, sequence 64) on data x pipe = 1 x 2, microbatches of 2 sequences,
M = 8, 16, 32 microbatches per step, this prints XLA's memory analysis of the Engine's compiled
train step (temp bytes: activations and other scratch) for GPipe with checkpoint_ratio 0, 0.5
(one of each stage's two layers under jax.checkpoint) and 1 (each tick rematerialised from its
input), circular (v=2) and 1F1B, and the per-device param bytes of the stacked layers against the
un-pipelined model's.

    python benchmarks/pipeline_memory.py
"""

from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

MICROBATCH = 2


def _engine(schedule: str, ratio: float, pipe: int):
    from titanax.config import config_for_function
    from titanax.modules.models.decoder import gpt_config
    from titanax.parallel.plan import DP, PP, Plan
    from titanax.runtime.mesh import MeshSpec
    from titanax.train import optimizers
    from titanax.train.engine import Engine
    from titanax.train.learner import Learner

    axes = ("data", "pipe") if pipe > 1 else ("data",)
    plan = Plan.default_config().set(data_parallel=DP.default_config())
    if pipe > 1:
        plan.pipeline_parallel = PP.default_config().set(
            schedule=schedule, microbatch_size=MICROBATCH, checkpoint_ratio=ratio,
            virtual_stages=2 if schedule == "circular" else 1)
    return Engine.default_config().set(
        mesh=MeshSpec.default_config().set(axes=axes, shape=(1, pipe) if pipe > 1 else (1,),
                                           devices=list(range(pipe))),
        plan=plan,
        model=gpt_config().set(name="gpt", vocab_size=256, max_seq_len=64, num_layers=4,
                                       model_dim=128, num_heads=4),
        learner=Learner.default_config().set(optimizer=config_for_function(optimizers.sgd).set(
            learning_rate=0.1)),
        loggers=[]).instantiate()


def main() -> None:
    from titanax.runtime.cpu_devices import simulate_cpu_devices
    simulate_cpu_devices(8)
    import jax
    import numpy as np

    def temp_mib(engine, count):
        engine.init_state()
        ids = np.random.default_rng(0).integers(0, 256, (count * MICROBATCH, 65)).astype(np.int32)
        compiled = engine.compile(example_batch={"input_ids": ids[:, :-1],
                                                 "target_ids": ids[:, 1:]}).latest
        return compiled.memory_analysis().temp_size_in_bytes / 2 ** 20

    counts = (8, 16, 32)
    print("schedule                 | " + " | ".join(f"temp MiB at M={m}" for m in counts)
          + " | M=32 / M=8")
    for schedule, ratio in (("gpipe", 0.0), ("gpipe", 0.5), ("gpipe", 1.0), ("circular", 0.0),
                            ("circular", 1.0), ("1f1b", 0.0)):
        values = [temp_mib(_engine(schedule, ratio, 2), m) for m in counts]
        label = schedule + (" v=2" if schedule == "circular" else "") + (
            f" checkpoint_ratio {ratio:g}" if schedule != "1f1b" else "")
        print(f"{label:24s} | " + " | ".join(f"{v:14.2f}" for v in values)
              + f" | {values[-1] / values[0]:.2f}", flush=True)

    def stacked_bytes(engine):
        engine.init_state()
        leaves = jax.tree_util.tree_leaves(engine.state.params["decoder"])
        device = jax.devices()[0]
        return sum(s.data.nbytes for leaf in leaves for s in leaf.addressable_shards
                   if s.device == device)

    plain, piped = stacked_bytes(_engine("1f1b", 0.0, 1)), stacked_bytes(_engine("1f1b", 0.0, 2))
    print(f"stacked-layer param bytes on device 0: {piped} with 2 stages vs {plain} without "
          f"({piped / plain:.2f})")


if __name__ == "__main__":
    main()
