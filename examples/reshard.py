"""Seed recipe 5: train with TP=2, save, restore with TP=4 and continue.

The checkpoint holds global arrays; restoring reads them straight into the shardings the *new*
plan gives every param, so nothing is gathered on one host. Run on 8 simulated CPU devices:

    python examples/reshard.py [--steps 20] [--dir /tmp/titanax_reshard]
"""

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titanax.runtime.cpu_devices import simulate_cpu_devices  # noqa: E402


def engine_for(model_axis: int, directory: str):
    from experiments.gpt import gpt_tiny_dp_tp  # pylint: disable=import-outside-toplevel
    from titanax.io.checkpointer import OrbaxCheckpoint  # pylint: disable=import-outside-toplevel
    cfg = gpt_tiny_dp_tp()
    cfg.mesh.shape = (None, model_axis)
    cfg.evalers = {}
    cfg.log_every = 5
    cfg.checkpoint = OrbaxCheckpoint.default_config().set(save_every_n_steps=0)
    # The run directory holds the checkpoints (directory/checkpoints) and the CSV/TensorBoard logs.
    return cfg.instantiate(trainer_dir=directory)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dir", default="/tmp/titanax_reshard")
    args = parser.parse_args()
    simulate_cpu_devices(8)
    shutil.rmtree(args.dir, ignore_errors=True)
    first = engine_for(2, args.dir)
    first.fit(steps=args.steps)
    first.close()
    weight = first.state.params["decoder"]["layer"]["mlp"]["up"]["weight"]
    print(f"TP=2: mesh {dict(first.mesh.shape)}, mlp/up/weight {weight.sharding.spec}, "
          f"local shard {weight.addressable_shards[0].data.shape}")
    second = engine_for(4, args.dir)
    second.fit(steps=2 * args.steps)  # Restores step `steps` onto the TP=4 mesh, continues.
    weight = second.state.params["decoder"]["layer"]["mlp"]["up"]["weight"]
    print(f"TP=4: mesh {dict(second.mesh.shape)}, mlp/up/weight {weight.sharding.spec}, "
          f"local shard {weight.addressable_shards[0].data.shape}; restored from "
          f"{second.restored_from}; now at step {int(second.state.step)}")
    second.close()


if __name__ == "__main__":
    main()
