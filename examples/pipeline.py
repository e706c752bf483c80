"""A GPT trained in 2 pipeline stages with the imperative Engine, both schedules side by side.

The decoder's 4 layers are split over the ``pipe`` axis (2 layers per stage) of a data x pipe =
4 x 2 mesh of 8 simulated CPU devices; each data shard's 4 sequences run as 4 microbatches. The
script trains the same model from the same init with 1F1B and with GPipe and prints both loss
curves (equal up to float rounding: the schedules differ in *when* work happens, not in what is
computed), the bubble and the explain() summary of the pipeline.

    python examples/pipeline.py [--steps 10]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from titanax.runtime.cpu_devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import titanax as tx  # noqa: E402
from titanax.data.pipeline import Input  # noqa: E402
from titanax.data.sources import TextWindows  # noqa: E402
from titanax.modules.models.decoder import gpt_config  # noqa: E402


def train(schedule: str, steps: int):
    engine = tx.Engine(
        mesh=tx.MeshSpec(axes=("data", "pipe"), shape=(4, 2)),
        plan=tx.Plan(data_parallel=tx.DP(axis="data"),
                     pipeline_parallel=tx.PP(axis="pipe", schedule=schedule, microbatch_size=1)),
        model=gpt_config().set(name="gpt", vocab_size=256, max_seq_len=64,
                                       num_layers=4, model_dim=128, num_heads=4),
        train_input=Input.default_config().set(
            source=TextWindows.default_config().set(seq_len=64), global_batch_size=16),
        loggers=[])
    engine.fit(steps=steps)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    runs = {schedule: train(schedule, args.steps) for schedule in ("1f1b", "gpipe")}
    for schedule, engine in runs.items():
        losses = " ".join(f"{h['loss']:.4f}" for h in engine.history)
        print(f"{schedule:5s} losses: {losses}")
    print(runs["1f1b"].explain().split("\n\n")[2])  # Mesh, params, then the pipeline.
    gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(runs["1f1b"].history,
                                                          runs["gpipe"].history))
    print(f"largest per-step loss difference between the schedules: {gap:.2e}")


if __name__ == "__main__":
    main()
