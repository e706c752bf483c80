"""Scan or unroll the layer stack? Compile time and step time of both, by depth.

``Repeat`` (GPT's ``decoder``) runs its layers as one ``lax.scan`` or, unrolled, as straight-line
code. Scanning keeps compile time flat in depth, but every step pays for the loop: XLA
zero-fills the scan's stacked outputs (the activations saved for backward and the stacked
gradients: 27 buffers, 19 MiB per step at the benchmark's small shape on 4x2) and cannot fuse
across layers. Unrolling removes both and costs compile time that grows with depth. This script
prints both, side by side, for the Engine's train step of a GPT at several depths (data x model =
4 x 2, 8 simulated CPU devices); the GPT default (``unroll_layers``) is chosen from it.

    python benchmarks/scan_vs_unroll.py [--depths 4,12,24] [--rounds 5] [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)


def _engine(depth: int, unroll: bool):
    from titanax.config import config_for_function
    from titanax.modules.models.decoder import gpt_config
    from titanax.parallel.plan import DP, TP, Plan
    from titanax.runtime.mesh import MeshSpec
    from titanax.train import optimizers
    from titanax.train.engine import Engine
    from titanax.train.learner import Learner

    return Engine.default_config().set(
        mesh=MeshSpec.default_config().set(axes=("data", "model"), shape=(4, 2)),
        plan=Plan.default_config().set(data_parallel=DP.default_config(),
                                       tensor_parallel=TP.default_config()),
        model=gpt_config().set(name="gpt", vocab_size=256, max_seq_len=64,
                                       num_layers=depth, model_dim=128, num_heads=4,
                                       unroll_layers=unroll),
        learner=Learner.default_config().set(optimizer=config_for_function(optimizers.adamw).set(
            learning_rate=1e-3)),
        loggers=[]).instantiate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="4,12,24")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    from titanax.runtime.cpu_devices import simulate_cpu_devices
    simulate_cpu_devices(8)
    import jax
    from tests.train.helpers import text_batches

    host = text_batches(batch_size=32, seq_len=64, count=1)[0]
    print("depth | mode   | compile s | step ms (median) | unrolled / scanned step")
    for depth in [int(d) for d in args.depths.split(",")]:
        runs = {}
        for unroll in (False, True):
            engine = _engine(depth, unroll)
            engine.init_state()
            batch = engine.global_batch(host)
            jax.clear_caches()
            started = time.perf_counter()
            step = engine.compile(example_batch=batch)
            compile_s = time.perf_counter() - started
            runs[unroll] = (engine, step, batch, compile_s, [])
        for round_index in range(args.rounds):
            for unroll in ((False, True) if round_index % 2 == 0 else (True, False)):
                engine, step, batch, _, times = runs[unroll]
                jax.block_until_ready(engine.state)
                started = time.perf_counter()
                for _ in range(args.steps):
                    engine.state, _ = step(engine.state, batch)
                jax.block_until_ready(engine.state)
                times.append((time.perf_counter() - started) / args.steps)
        ratios = [u / s for u, s in zip(runs[True][4], runs[False][4])]
        for unroll in (False, True):
            _, _, _, compile_s, times = runs[unroll]
            print(f"{depth:5d} | {'unroll' if unroll else 'scan':6s} | {compile_s:9.1f} | "
                  f"{1e3 * statistics.median(times):16.1f} | "
                  f"{statistics.median(ratios):.2f}" if unroll else
                  f"{depth:5d} | {'scan':6s} | {compile_s:9.1f} | "
                  f"{1e3 * statistics.median(times):16.1f} |", flush=True)


if __name__ == "__main__":
    main()
