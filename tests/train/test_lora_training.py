"""LoRA through the engine (``Engine.Config.lora``): the adapters' updates equal SGD with momentum
on gradients of the hand-written merged model (``jax.grad`` on one device, no Titanax step)
under DP, TP, FSDP, PP (1F1B, GPipe) and CP; the frozen weights leave training bit for bit as they came; the optimizer
holds state for the adapters only; and the compiled step reduces no frozen weight's gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.modules import lora_reference
from tests.numerics import assert_close, assert_identical
from tests.train import helpers
from titanax.io.checkpointer import OrbaxCheckpoint
from titanax.modules import functional
from titanax.modules.lora import LoRA
from titanax.modules.models.decoder import Decoder
from titanax.parallel.context_parallel import CP
from titanax.parallel.plan import DP, PP, TP, Plan, ZeRO
from titanax.train.engine import Engine

pytestmark = pytest.mark.usefixtures("float64_numerics")

BATCHES = helpers.text_batches(batch_size=16, count=2)
MODEL = dict(name="llama", vocab_size=256, max_seq_len=128, model_dim=32,
             num_heads=8, num_kv_heads=2, hidden_dim=48, unroll_layers=False)
LR, MOMENTUM = 0.5, 0.9
LORA = dict(rank=4, alpha=8.0)


def _engine(*, data, model=1, pipe=1, context=1, zero=None, schedule="1f1b",
            checkpoint=None, remat=None, use_lora=True, layers=2, accumulate=1,
            grad_sync="per_step", frozen_dtype=None):
    """``zero``: the ZeRO stage (None: none)."""
    sizes = {"data": data, "pipe": pipe, "context": context, "model": model}
    axes = tuple(a for a in sizes if a == "data" or sizes[a] > 1)
    learner = helpers.sgd(LR)
    learner.optimizer.momentum = MOMENTUM
    plan = Plan.default_config().set(
        data_parallel=DP.default_config().set(accumulate_steps=accumulate),
        tensor_parallel=TP.default_config() if model > 1 else None,
        pipeline_parallel=(PP.default_config().set(
            microbatch_size=2, schedule=schedule,
            virtual_stages=2 if schedule == "circular" else 1) if pipe > 1 else None),
        context_parallel=CP.default_config().set(axis="context") if context > 1 else None,
        zero=(ZeRO.default_config().set(stage=zero, min_shard_size=16, grad_sync=grad_sync)
              if zero else None))
    cfg = Engine.default_config().set(
        mesh=helpers.mesh(tuple(sizes[a] for a in axes), axes,
                          devices=list(range(data * model * pipe * context))),
        plan=plan, model=Decoder.default_config().set(**MODEL, layer_remat_policy=remat,
                                                      num_layers=layers),
        lora=LoRA.default_config().set(**LORA, frozen_dtype=frozen_dtype) if use_lora else None,
        learner=learner,
        loggers=[], log_every=1000, precision=helpers.test_precision(),
        checkpoint=(OrbaxCheckpoint.default_config().set(path=str(checkpoint))
                    if checkpoint is not None else None))
    return cfg.instantiate()


def _split(params):
    flat = helpers.flat(params)
    adapters = {k: v for k, v in flat.items() if lora_reference.is_adapter(k)}
    return adapters, {k: v for k, v in flat.items() if k not in adapters}


@functools.lru_cache(maxsize=None)
def _reference(layers=2):
    """``(initial params, adapters after the batches)``: SGD with momentum by hand on the
    gradients of the merged model's mean loss over each whole batch."""
    engine = _engine(data=1, layers=layers)
    engine.init_or_restore()
    start = jax.tree_util.tree_map(np.asarray, jax.device_get(engine.canonical_params()))
    model = engine.model
    scale = LoRA.default_config().set(**LORA).instantiate().scale

    def loss(adapters, frozen, batch):
        params = _unflatten({**adapters, **frozen})
        return functional(model, None, lora_reference.merged(params, scale), (batch,),
                          is_training=False)[0][0]

    adapters, frozen = _split(start)
    adapters = {k: jnp.asarray(v) for k, v in adapters.items()}
    velocity = {k: jnp.zeros_like(v) for k, v in adapters.items()}
    grad = jax.jit(jax.grad(loss))
    for batch in BATCHES:
        grads = grad(adapters, frozen, {k: jnp.asarray(v) for k, v in batch.items()})
        velocity = {k: MOMENTUM * velocity[k] + grads[k] for k in adapters}
        adapters = {k: adapters[k] - LR * velocity[k] for k in adapters}
    return start, {k: np.asarray(v) for k, v in adapters.items()}


def _unflatten(flat):
    tree = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return tree


@pytest.mark.parametrize("layout", [
    dict(data=8), dict(data=4, model=2), dict(data=4, zero=3),
    dict(data=4, zero=3, grad_sync="per_microbatch", accumulate=2), dict(data=8, zero=1),
    dict(data=4, model=2, zero=2), dict(data=2, pipe=2, model=2),
    dict(data=4, pipe=2, schedule="gpipe"), dict(data=4, pipe=2, schedule="circular", layers=4),
    dict(data=2, context=4)],
    ids=["dp8", "dp4-tp2", "fsdp4", "fsdp4-per-microbatch-acc2", "zero1-dp8", "zero2-dp4-tp2",
         "dp2-pp2-tp2-1f1b", "dp4-pp2-gpipe", "dp4-pp2-circular-v2", "dp2-cp4"])
def test_adapters_train_as_by_hand_and_frozen_weights_stay_bit_identical(layout):
    start, want = _reference(layout.get("layers", 2))
    engine = _engine(**layout)
    _, params = helpers.train(engine, BATCHES)
    adapters, frozen = _split(params)
    start_adapters, start_frozen = _split(start)
    assert set(adapters) == set(want) and len(want) == 2 * 6
    assert_close(adapters, want, what="adapters after 2 SGD-momentum steps")
    assert any(np.abs(adapters[k] - start_adapters[k]).max() > 1e-3 for k in adapters)
    assert_identical(frozen, start_frozen, what="frozen weights")
    # The optimizer's momentum exists for the adapters only.
    state_leaves = jax.tree_util.tree_leaves(engine.state.opt_state)
    adapter_sizes = sorted(v.size for v in adapters.values())
    assert sorted(x.size for x in state_leaves if x.size > 1) == adapter_sizes


def test_the_compiled_step_reduces_adapter_gradients_only():
    engine = _engine(data=8)
    helpers.train(engine, BATCHES[:1])
    adapters, frozen = _split(jax.device_get(engine.canonical_params()))
    reduced = sum(op.bytes for op in engine.collectives()
                  if op.op in ("all-reduce", "reduce-scatter") and "data" in op.axes)
    adapter_bytes = sum(v.nbytes for v in adapters.values())
    smallest_frozen = min(v.nbytes for v in frozen.values() if v.ndim > 1)
    # The gradients of the adapters and a few scalar metrics; not one frozen weight's.
    assert adapter_bytes <= reduced < adapter_bytes + smallest_frozen, (reduced, adapter_bytes)


def test_a_lora_run_resumes_bit_identically(tmp_path):
    """The checkpoint holds the adapters, their optimizer state and the frozen weights."""
    straight = _engine(data=4, model=2, checkpoint=tmp_path / "straight")
    straight.fit(data=iter(BATCHES + BATCHES[:1]), steps=3)
    first = _engine(data=4, model=2, checkpoint=tmp_path / "resumed")
    first.fit(data=iter(BATCHES), steps=2)
    first.close()
    second = _engine(data=4, model=2, checkpoint=tmp_path / "resumed")
    second.fit(data=iter(BATCHES[:1]), steps=3)
    assert second.restored_from.endswith("/2")
    assert_identical(jax.device_get(second.state.params), jax.device_get(straight.state.params))
    assert_identical(jax.device_get(second.state.opt_state),
                     jax.device_get(straight.state.opt_state))


def test_explain_shows_the_trainable_share_and_what_freezing_saves():
    engine = _engine(data=8)
    helpers.train(engine, BATCHES[:1])
    text = engine.explain()
    adapters, frozen = _split(jax.device_get(engine.canonical_params()))
    trained = sum(v.size for v in adapters.values())
    total = trained + sum(v.size for v in frozen.values())
    assert f"trainable params {trained:,} of {total:,}" in text, text
    assert "get no gradient and no optimizer state" in text


def _temp_bytes(*, use_lora: bool, batch) -> int:
    engine = _engine(data=8, remat="dots_with_no_batch_dims_saveable", use_lora=use_lora)
    engine.init_or_restore()
    engine.compile(example_batch=batch)
    return engine.compiled_train_step().latest.memory_analysis().temp_size_in_bytes


def test_adapters_keep_no_activation_beside_their_weights_products():
    """Under a remat policy that saves dot outputs, the adapters' updates (weight-output sized)
    are recomputed, not saved: the step's temp memory is the full fine-tune's, give or take
    less than half the smallest update (k's: a device's 256 tokens x 2 kv heads x width 4, in
    float32 -- 8 KiB; saving the updates measured +264 KiB here)."""
    batch = helpers.text_batches(batch_size=16, seq_len=128, count=1)[0]
    adapted = _temp_bytes(use_lora=True, batch=batch)
    full = _temp_bytes(use_lora=False, batch=batch)
    assert adapted <= full + 4096, (adapted, full)


def test_a_mixture_with_router_state_updates_trains_its_adapters():
    """Aux-loss-free balancing writes the router's bias as a state update (numbered among all
    params, frozen ones included): with adapters it still lands on the bias, and only there."""
    from titanax.modules.layers.moe import MoE  # pylint: disable=import-outside-toplevel
    from titanax.modules.layers.router import Router  # pylint: disable=import-outside-toplevel
    learner = helpers.sgd(LR)
    cfg = Engine.default_config().set(
        mesh=helpers.mesh((2,), ("data",), devices=[0, 1]),
        plan=Plan.default_config().set(data_parallel=DP.default_config()),
        model=Decoder.default_config().set(
            **MODEL, num_layers=2, moe=MoE.default_config().set(
                num_experts=4, top_k=2, hidden_dim=16,
                router=Router.default_config().set(balance_rate=0.01))),
        lora=LoRA.default_config().set(**LORA), learner=learner, loggers=[], log_every=1000,
        precision=helpers.test_precision())
    engine = cfg.instantiate()
    engine.init_or_restore()
    start = helpers.flat(jax.device_get(engine.canonical_params()))
    _, params = helpers.train(engine, BATCHES)
    moved = {k for k, v in helpers.flat(params).items()
             if not np.array_equal(v, start[k]) and not lora_reference.is_adapter(k)}
    assert moved and all("router" in k and "bias" in k for k in moved), moved


def test_a_hand_written_step_is_refused_when_params_are_frozen():
    from titanax import errors  # pylint: disable=import-outside-toplevel
    from titanax.train.user_step import step_fn  # pylint: disable=import-outside-toplevel

    @step_fn
    def step(state, batch):
        return state, {"loss": jnp.zeros(())}

    engine = _engine(data=8)
    with pytest.raises(errors.StepError, match="freezes some"):
        engine.fit(step, data=iter(BATCHES), steps=1)


def test_a_bfloat16_base_is_stored_so_and_stays_bit_identical():
    """``lora.frozen_dtype="bfloat16"``: the frozen weights in half the bytes (and their
    checkpoints), the adapters and their optimizer state in the precision's float32."""
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    engine = _engine(data=4, model=2, frozen_dtype="bfloat16")
    engine.init_or_restore()
    start = helpers.flat(jax.device_get(engine.canonical_params()))
    adapters, frozen = _split(jax.device_get(engine.canonical_params()))
    assert {v.dtype for v in frozen.values()} == {np.dtype(jnp.bfloat16)}
    assert {v.dtype for v in adapters.values()} != {np.dtype(jnp.bfloat16)}
    _, params = helpers.train(engine, BATCHES)
    end_adapters, end_frozen = _split(params)
    assert_identical(end_frozen, {k: start[k] for k in end_frozen}, what="the bfloat16 base")
    assert any(np.abs(end_adapters[k] - adapters[k]).max() > 1e-3 for k in adapters)
