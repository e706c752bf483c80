"""Per-device memory of sharded state, from the compiled train step's memory analysis.

For a GPT whose weights dominate its activations (one short sequence per device), on 8 simulated
CPU devices, each strategy's compiled step reports

* ``state``: params + optimizer state held per device (the step's donated arguments, from
  ``engine.state``'s addressable shards), and its ratio to the replicated run's;
* ``temp``: the step's peak temporary bytes (XLA's memory analysis) -- under FSDP this holds the
  gathered weights, so it is shown in units of one layer's gathered weights: ``per_microbatch``
  (true ZeRO-3) must stay near two layers whatever the depth, ``per_step`` holds them all.

Each strategy is compiled with the model's ``unroll_layers`` False and True. FSDP with per-layer
gathers runs the stack as a loop either way (``scan_in_context``), so its two rows must agree.

Then the same sizes as a GPT written in Flax NNX (``experiments/flax_models/nnx_gpt.py``) trained
through the ``FlaxNNX`` adapter, its blocks stacked and run by ``nnx.scan`` or listed: under FSDP the scanned
one must hold about as few gathered layers as Titanax's own (the adapter rematerialises each
iteration of the module's scan), the listed one holds them all.

    python benchmarks/fsdp_memory.py [--layers 8] [--width 256]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from titanax.config import config_for_function  # noqa: E402
from titanax.modules.models.decoder import gpt_config  # noqa: E402
from titanax.observe import state_report  # noqa: E402
from titanax.parallel.plan import DP, Plan, ZeRO  # noqa: E402
from titanax.runtime.mesh import MeshSpec  # noqa: E402
from titanax.train import optimizers  # noqa: E402
from titanax.train.engine import Engine  # noqa: E402
from titanax.train.learner import Learner  # noqa: E402

STRATEGIES = {
    "replicated": None,
    "zero1": dict(stage=1),
    "zero2": dict(stage=2),
    "fsdp per_step": dict(stage=3, grad_sync="per_step"),
    "fsdp per_microbatch": dict(stage=3, grad_sync="per_microbatch"),
    # HSDP: FSDP over an fsdp axis of 4 next to data = 2 (state 1/4, not 1/8, per device).
    "hsdp 2x4 per_microbatch": dict(stage=3, grad_sync="per_microbatch", axis="fsdp"),
}


def _engine(zero, *, layers: int, width: int, unroll: bool) -> Engine:
    model = gpt_config().set(name="gpt", vocab_size=256, max_seq_len=16,
                                     num_layers=layers, model_dim=width, num_heads=4,
                                     unroll_layers=unroll)
    plan = Plan.default_config().set(data_parallel=DP.default_config(),
                                     zero=ZeRO.default_config().set(**zero) if zero else None)
    hsdp = bool(zero) and zero.get("axis") == "fsdp"
    mesh = MeshSpec.default_config().set(axes=("data", "fsdp") if hsdp else ("data",),
                                         shape=(2, 4) if hsdp else (8,))
    return Engine.default_config().set(
        mesh=mesh, plan=plan, model=model,
        learner=Learner.default_config().set(
            optimizer=config_for_function(optimizers.adamw).set(learning_rate=1e-3)),
        loggers=[], log_every=1000).instantiate()


def _nnx_engine(zero, *, layers: int, width: int, scan: bool) -> Engine:
    from titanax_experiments.flax_nnx import nnx_gpt  # pylint: disable=import-outside-toplevel
    engine = _engine(zero, layers=layers, width=width, unroll=False)
    cfg = engine.config.clone(model=nnx_gpt(seq_len=16, num_layers=layers, model_dim=width,
                                            num_heads=4, scan_layers=scan))
    return cfg.instantiate()


def _device0_bytes(tree) -> int:
    device = jax.devices()[0]
    return sum(s.data.nbytes for leaf in jax.tree_util.tree_leaves(tree)
               for s in leaf.addressable_shards if s.device == device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    batch = {"input_ids": rng.integers(0, 256, (8, 16)).astype(np.int32),
             "target_ids": rng.integers(0, 256, (8, 16)).astype(np.int32)}
    d = args.width
    one_layer = None
    replicated_state = None
    for unroll in (False, True):
        for name, zero in STRATEGIES.items():
            engine = _engine(zero, layers=args.layers, width=d, unroll=unroll)
            if one_layer is None:
                one_layer = state_report.one_layer_bytes(engine.build().parameter_specs, 4)
                print(f"GPT {args.layers} layers x {d} wide on 8 devices; one layer's weights "
                      f"{one_layer / 2 ** 20:.2f} MiB")
                print(f"{'strategy':<25}{'unroll_layers':<15}{'state MiB':>10}{'/replicated':>12}"
                      f"{'temp MiB':>10}{'temp/layer':>11}")
            engine.init_state()
            engine.compile(example_batch=batch)
            state = _device0_bytes((engine.state.params, engine.state.opt_state))
            if zero is None:
                replicated_state = state
            temp = engine._train_step.latest.memory_analysis().temp_size_in_bytes  # pylint: disable=protected-access
            print(f"{name:<25}{str(unroll):<15}{state / 2 ** 20:>10.2f}"
                  f"{state / replicated_state:>12.3f}{temp / 2 ** 20:>10.2f}"
                  f"{temp / one_layer:>11.2f}", flush=True)
    print(f"\n{'Flax NNX GPT (FlaxNNX)':<25}{'blocks':<15}{'state MiB':>10}{'temp MiB':>22}"
          f"{'temp/layer':>11}")
    for scan in (True, False):
        for name in ("replicated", "fsdp per_microbatch"):
            engine = _nnx_engine(STRATEGIES[name], layers=args.layers, width=d, scan=scan)
            engine.init_state()
            engine.compile(example_batch=batch)
            state = _device0_bytes((engine.state.params, engine.state.opt_state))
            temp = engine.compiled_train_step().latest.memory_analysis().temp_size_in_bytes
            print(f"{name:<25}{'nnx.scan' if scan else 'nnx.List':<15}{state / 2 ** 20:>10.2f}"
                  f"{temp / 2 ** 20:>22.2f}{temp / one_layer:>11.2f}", flush=True)


if __name__ == "__main__":
    main()
