"""Does an async save stall training? Step time with a save in flight vs without (GPT tiny).

Trains gpt_tiny_dp_tp's model on 8 simulated CPU devices; in each round, times a few steps right
after starting an async save and a few steps with no save in flight, and prints the ratio of the
medians (1.0 means saving costs the training loop nothing).

    python benchmarks/async_checkpoint.py [--rounds 6] [--steps 4]
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    from titanax.runtime.cpu_devices import simulate_cpu_devices
    simulate_cpu_devices(8)
    import jax

    from experiments.gpt import gpt_tiny_dp_tp
    from titanax.io.checkpointer import OrbaxCheckpoint

    directory = tempfile.mkdtemp(prefix="titanax_async_bench_")
    cfg = gpt_tiny_dp_tp()
    cfg.evalers, cfg.loggers = {}, []
    cfg.checkpoint = OrbaxCheckpoint.default_config().set(path=directory, save_every_n_steps=0,
                                                          keep_last_n=2)
    engine = cfg.instantiate()
    engine.init_state()
    data = iter(engine.make_input(cfg.train_input, where="train_input"))
    batches = [engine.global_batch(next(data)) for _ in range(2)]

    def timed_steps(count):
        times = []
        for index in range(count):
            start = time.perf_counter()
            jax.block_until_ready(engine.train_step(batches[index % 2]))
            times.append(time.perf_counter() - start)
        return times

    timed_steps(3)  # Compile and warm up.
    with_save, without, blocking = [], [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        engine.save()  # Blocks only to copy the arrays off the device and start the writer.
        blocking.append(time.perf_counter() - start)
        in_flight = engine.checkpointer().manager.is_saving_in_progress()
        with_save += timed_steps(args.steps)
        if not in_flight:
            print("note: the save finished before the first timed step started")
        engine.checkpointer().wait_until_finished()
        without += timed_steps(args.steps)
    saving, plain = statistics.median(with_save), statistics.median(without)
    params_mb = sum(x.nbytes for x in jax.tree_util.tree_leaves(engine.state.params)) / 2 ** 20
    print(f"GPT tiny ({params_mb:.1f} MiB params + Adam state), {args.rounds} rounds x "
          f"{args.steps} steps each")
    print(f"step with a save in flight: median {saving * 1e3:.1f} ms")
    print(f"step without:               median {plain * 1e3:.1f} ms")
    print(f"ratio: {saving / plain:.3f}")
    print(f"save() itself blocked the loop for a median {statistics.median(blocking) * 1e3:.1f} "
          "ms (device-to-host copy; the write runs in the background)")
    engine.close()
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
