"""Engine step vs a hand-written ``jit(shard_map(...))`` step of the same GPT.

Both run the same model, params, shardings (data x model mesh), batch and AdamW; the hand-written
step does only what any explicit DP x TP step must: cast params to varying, value_and_grad,
reduce each gradient once (mean over data, sum over model for TP-replicated params), update. The
engine's step additionally computes the global gradient norm, the learning rate, finite checks and
reduced metrics. Rounds alternate between the two (this machine is shared and noisy) and the ratio
of median step times is printed.

    python benchmarks/overhead.py [--rounds 7] [--steps 20] [--cpu_devices 8]
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cpu_devices", type=int, default=8)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    from titanax.runtime.cpu_devices import simulate_cpu_devices
    if args.cpu_devices:
        simulate_cpu_devices(args.cpu_devices)
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    from titanax.config import config_for_function
    from titanax.data.sources import TextWindows
    from titanax.modules import functional
    from titanax.modules.models.gpt import GPT
    from titanax.parallel import collectives, rules
    from titanax.parallel.plan import DP, TP, Plan
    from titanax.runtime.mesh import MeshSpec
    from titanax.train import optimizers
    from titanax.train.engine import Engine
    from titanax.train.learner import Learner
    import numpy as np

    model_cfg = GPT.default_config().set(name="gpt", vocab_size=256, max_seq_len=64, num_layers=4,
                                         model_dim=128, num_heads=4, tp_axis="model")
    engine = Engine.default_config().set(
        mesh=MeshSpec.default_config().set(axes=("data", "model"), shape=(None, 2)),
        plan=Plan.default_config().set(data_parallel=DP.default_config(),
                                       tensor_parallel=TP.default_config()),
        model=model_cfg,
        learner=Learner.default_config().set(optimizer=config_for_function(
            optimizers.adamw).set(learning_rate=1e-3)),
        loggers=[]).instantiate()
    engine.init_state()
    source = TextWindows.default_config().set(seq_len=64).instantiate()
    records = [source[i] for i in range(16)]
    host = {k: np.stack([r[k] for r in records]) for k in records[0]}
    batch = engine.global_batch(host)
    engine_step = engine.compile(example_batch=batch)

    # The hand-written step.
    model, mesh, specs = engine.model, engine.mesh, engine.param_specs
    tx = optax.adamw(1e-3, weight_decay=0.0)
    axes = tuple(mesh.axis_names)

    def local(params, opt_state, b):
        varying = collectives.cast_varying(params, axes)
        loss, grads = jax.value_and_grad(
            lambda p: functional(model, None, p, (b,), is_training=True)[0][0])(varying)

        def reduce(g, spec):
            g = collectives.pmean(g, "data")
            return g if "model" in rules.spec_axes(spec) else collectives.psum(g, "model")

        grads = jax.tree_util.tree_map(reduce, grads, specs)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, collectives.pmean(loss, "data")

    opt_specs = jax.tree_util.tree_map(lambda _: P(), jax.eval_shape(tx.init, engine.state.params))
    opt_specs = optax.tree_map_params(tx, lambda _, s: s, opt_specs, specs,
                                      transform_non_params=lambda _: P(),
                                      is_leaf=lambda x: isinstance(x, P))
    batch_specs = engine.batch_specs(batch)
    hand = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, opt_specs, batch_specs),
                                 out_specs=(specs, opt_specs, P())), donate_argnums=(0, 1))
    params = jax.tree_util.tree_map(jnp.copy, engine.state.params)
    opt_state = jax.jit(tx.init)(params)
    hand_compiled = hand.lower(params, opt_state, batch).compile()

    def time_engine(steps):
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.state, metrics = engine_step(engine.state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        return times

    def time_hand(steps):
        nonlocal params, opt_state
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            params, opt_state, loss = hand_compiled(params, opt_state, batch)
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - start)
        return times

    time_engine(3), time_hand(3)  # Warm up.
    engine_times, hand_times = [], []
    for _ in range(args.rounds):
        engine_times += time_engine(args.steps)
        hand_times += time_hand(args.steps)
    engine_median = statistics.median(engine_times)
    hand_median = statistics.median(hand_times)
    ratio = engine_median / hand_median
    print(f"mesh {dict(mesh.shape)}  GPT 4x128  batch 16x64  {args.rounds} rounds x "
          f"{args.steps} steps each, interleaved")
    print(f"engine step       median {engine_median * 1e3:8.2f} ms")
    print(f"hand-written step median {hand_median * 1e3:8.2f} ms")
    print(f"ratio engine / hand-written: {ratio:.3f}  (target <= 1.05)")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"engine_ms": engine_median * 1e3, "hand_ms": hand_median * 1e3,
                       "ratio": ratio, "devices": jax.device_count(),
                       "platform": jax.default_backend()}, f, indent=2)


if __name__ == "__main__":
    main()
