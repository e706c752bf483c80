"""Expert parallelism (a mixture of experts' experts split over a mesh axis) against one device.

SGD with momentum, float32, batches whose rows train on different numbers of tokens; the capacity
factor is E / top_k (nothing can drop) unless a test says otherwise. Compared: the per-step losses
and every param's *update* (after - before), at the scale of each tensor.
"""

import functools
import math

import jax
import numpy as np
import pytest

from tests.numerics import FLOAT64, assert_close
from tests.train import helpers
from titanax import errors
from titanax.modules.layers.moe import MoE
from titanax.modules.models.decoder import Decoder
from titanax.modules.module import functional
from titanax.parallel.context_parallel import CP
from titanax.parallel.expert_parallel import EP
from titanax.parallel.plan import DP, PP, TP, Plan, ZeRO
from titanax.train.engine import Engine

pytestmark = pytest.mark.usefixtures("float64_numerics")

BATCHES = helpers.text_batches(batch_size=8, count=2, uneven=True)
MODEL = dict(name="llama", vocab_size=256, max_seq_len=16, num_layers=2, model_dim=32,
             num_heads=8, num_kv_heads=2, hidden_dim=48)
EXPERTS, TOP_K = 8, 2


class RecordingMoE(MoE):
    """An MoE layer that also hands back its routing (for the dropped-fraction test)."""

    def _report(self, routing, kept):
        super()._report(routing, kept)
        self.add_module_output("expert_ids", routing.expert_ids)


def _moe(**changes):
    return MoE.default_config().set(hidden_dim=24, num_experts=EXPERTS, top_k=TOP_K,
                                    capacity_factor=EXPERTS / TOP_K).set(**changes)


def _engine(sizes=None, *, moe=None, tp=False, fsdp=False, zero=None, pipe=None, learner=None,
            also_over=(), **model):
    sizes = sizes or {"data": 1}
    axes, shape = tuple(sizes), tuple(sizes.values())
    plan = Plan.default_config().set(
        data_parallel=DP.default_config(),
        expert_parallel=EP.default_config() if "expert" in sizes else None,
        context_parallel=CP.default_config() if "context" in sizes else None,
        tensor_parallel=TP.default_config() if tp else None,
        pipeline_parallel=(PP.default_config().set(microbatch_size=1, schedule=pipe)
                           if pipe else None),
        zero=(ZeRO.default_config().set(stage=3, min_shard_size=64,
                                        axis="fsdp" if "fsdp" in sizes else None,
                                        grad_sync="per_step" if pipe else "per_microbatch",
                                        also_over=also_over)
              if fsdp else ZeRO.default_config().set(stage=zero, min_shard_size=64)
              if zero else None))
    network = Decoder.default_config().set(**MODEL, moe=moe or _moe()).set(**model)
    if learner is None:
        learner = helpers.sgd(0.5)
        learner.optimizer.momentum = 0.9
    cfg = Engine.default_config().set(
        mesh=helpers.mesh(shape, axes, devices=list(range(math.prod(shape)))), plan=plan,
        model=network, learner=learner, loggers=[], log_every=1000,
        precision=helpers.test_precision())
    return cfg.instantiate()


def _updates(engine, batches=BATCHES):
    """Per-step losses and every param's update over the batches, with the params after (their
    storage bounds how finely an update can be read)."""
    engine.init_state()
    before = helpers.flat(jax.device_get(engine.canonical_params()))
    losses, after = helpers.train(engine, batches)
    after = helpers.flat(after)
    return losses, {k: (after[k].astype(np.float64) - before[k], after[k]) for k in after}, engine


def _assert_updates_close(updates, want_updates):
    """Each update within FLOAT64 of its own scale -- plus the resolution of the params it is
    read from (twice their dtype's spacing at their magnitude; a wrong scale or a missing shard
    moves an update by its own size)."""
    for path, (want, stored) in want_updates.items():
        got = updates[path][0]
        assert np.max(np.abs(want)) > 0, f"{path} never moved: the comparison proves nothing"
        resolution = 2 * np.spacing(np.max(np.abs(stored)))
        error = np.max(np.abs(got - want))
        assert error <= FLOAT64 * np.max(np.abs(want)) + resolution, (
            f"{path} update differs by {error:.3g} (scale {np.max(np.abs(want)):.3g}, "
            f"resolution {resolution:.3g})")


@functools.lru_cache(maxsize=None)
def _one_device():
    losses, updates, _ = _updates(_engine())
    return losses, updates


@pytest.mark.parametrize("sizes,case", [
    ({"data": 1, "expert": 2}, "ep"), ({"data": 1, "expert": 4}, "ep"),
    ({"data": 1, "expert": 8}, "ep"), ({"data": 2, "expert": 4}, "ep"),
    ({"data": 2, "expert": 4}, "fsdp"), ({"data": 1, "expert": 4, "model": 2}, "tp"),
    ({"data": 2, "expert": 2, "model": 2}, "tp"), ({"data": 2, "fsdp": 2, "expert": 2}, "fsdp"),
    ({"data": 2, "expert": 4}, "zero1"), ({"data": 2, "expert": 4}, "zero2"),
    ({"data": 1, "context": 2, "expert": 4}, "cp"),
    ({"data": 1, "expert": 4, "pipe": 2}, "gpipe"), ({"data": 1, "expert": 4, "pipe": 2}, "1f1b"),
], ids=["ep2", "ep4", "ep8", "dp2-ep4", "fsdp2-ep4", "ep4-tp2", "dp2-ep2-tp2", "hsdp2x2-ep2", "zero1-dp2-ep4",
        "zero2-dp2-ep4", "cp2-ep4",
        "ep4-gpipe2",
        "ep4-1f1b2"])
def test_expert_parallel_trains_like_one_device(sizes, case):
    """EP alone (2, 4, 8 experts ranks), with DP, FSDP (every param split over data as well,
    gathered per layer), HSDP (FSDP over an axis of its own next to data), ZeRO-1 / 2 (the
    optimizer state split over data), TP (each expert's hidden features over model), CP (each
    rank routes its part of every row) and PP (each stage's experts exchange tokens inside the
    schedule)."""
    engine = _engine(sizes, tp=case == "tp", fsdp=case == "fsdp",
                     zero=int(case[-1]) if case.startswith("zero") else None,
                     pipe=case if case in ("gpipe", "1f1b") else None)
    want_losses, want_updates = _one_device()
    losses, updates, engine = _updates(engine)
    assert_close(losses, want_losses, what="losses")
    _assert_updates_close(updates, want_updates)
    experts = engine.layout.param_specs["decoder"]["layer"]["mlp"]["gate_up_weight"]
    assert "expert" in tuple(experts)


def test_fsdp_also_over_the_expert_axis_trains_like_one_device():
    """``zero.also_over=("expert",)``: the dense params split over data x expert (each gather
    spans both, its transpose sums over both), the experts over data on top of their expert
    split -- every param spread over all eight devices, the steps those of one device."""
    engine = _engine({"data": 2, "expert": 4}, fsdp=True, also_over=("expert",))
    one = _engine()
    ids = np.asarray(BATCHES[0]["input_ids"])
    for run in (engine, one):
        run.init_state()
    # A model call outside the step (generation, evaluation harnesses) gathers them too.
    logits = engine.steps.model_method("logits")(engine.state.params, ids)
    assert_close(np.asarray(logits), np.asarray(one.steps.model_method("logits")(
        one.state.params, ids)), what="logits of a model call")
    want_losses, want_updates = _one_device()
    losses, updates, engine = _updates(engine)
    assert_close(losses, want_losses, what="losses")
    _assert_updates_close(updates, want_updates)
    specs = engine.layout.param_specs["decoder"]["layer"]
    assert ("data", "expert") in tuple(specs["attn"]["q_weight"]), specs["attn"]["q_weight"]
    experts = tuple(specs["mlp"]["gate_up_weight"])
    assert "expert" in experts and "data" in experts and ("data", "expert") not in experts
    assert "'data' x 'expert'" in engine.states.strategy.title


def test_dropless_dispatch_trains_like_capacity_slots_that_never_drop():
    """The ragged path (sorted by expert, ``ragged_dot``) and the slot path compute the same
    model when nothing drops; under EP the dropless exchange is emulated by a slot per token."""
    want_losses, want_updates = _one_device()
    for sizes in ({"data": 1}, {"data": 2, "expert": 4}):
        losses, updates, _ = _updates(_engine(sizes, moe=_moe(dispatch="dropless")))
        assert_close(losses, want_losses, what=f"dropless losses on {sizes}")
        _assert_updates_close(updates, want_updates)


@pytest.mark.parametrize("capacity_factor", [EXPERTS / TOP_K, 0.5])
def test_expert_parallel_with_balancing_trains_like_the_same_shards_without_it(capacity_factor):
    """Balancing losses, aux-loss-free bias and (at factor 0.5) dropped tokens are computed per
    token group -- one device's rows -- so EP (data 2 x expert 4) is compared with data=8: the
    same groups. Every term and every drop must come out the same."""
    moe = _moe(capacity_factor=capacity_factor, aux_loss_weight=0.05, z_loss_weight=0.01)
    moe.router.balance_rate = 0.01
    want_losses, want_updates, want = _updates(_engine({"data": 8}, moe=moe))
    losses, updates, got = _updates(_engine({"data": 2, "expert": 4}, moe=moe))
    assert_close(losses, want_losses, what="losses")
    _assert_updates_close(updates, want_updates)
    bias = want_updates["decoder/layer/mlp/router/expert_bias"][0]
    assert np.max(np.abs(bias)) > 0  # The aux-loss-free bias moved.
    dropped = "summaries/decoder/layer/mlp/dropped_fraction"
    assert_close([h[dropped] for h in got.history], [h[dropped] for h in want.history],
                 what="dropped fractions")
    if capacity_factor < 1:
        assert all(h[dropped] > 0 for h in got.history)


def test_balancing_losses_reach_the_gradient_and_not_the_reported_loss():
    """One device, one SGD step: the update is -lr x the gradient of the language-model loss
    plus the weighted balancing and z losses of every layer, computed here from the layers'
    summaries; the reported loss is the language-model loss alone."""
    weights = dict(aux_loss_weight=0.3, z_loss_weight=0.2)
    engine = _engine(moe=_moe(**weights), learner=helpers.sgd(0.5))
    engine.init_state()
    params = jax.device_get(engine.canonical_params())
    batch = BATCHES[0]
    model = engine.model

    def objective(p, scale):
        (loss, _), collection = functional(model, None, p, (batch,), is_training=False)
        mlp = collection.summaries["decoder"]["layer"]["mlp"]
        return loss + scale * (weights["aux_loss_weight"] * jax.numpy.sum(mlp["aux_loss"])
                               + weights["z_loss_weight"] * jax.numpy.sum(mlp["z_loss"])), loss

    (_, lm_loss), grads = jax.value_and_grad(objective, has_aux=True)(params, 1.0)
    _, lm_grads = jax.value_and_grad(objective, has_aux=True)(params, 0.0)
    losses, after = helpers.train(engine, [batch])
    assert_close(losses[0], lm_loss, what="reported loss")
    before, after = helpers.flat(params), helpers.flat(after)
    _assert_updates_close({k: (after[k].astype(np.float64) - before[k], None) for k in after},
                          {k: (-0.5 * g.astype(np.float64), after[k])
                           for k, g in helpers.flat(grads).items()})
    # The balancing terms are large enough here that leaving them out would fail above.
    router = "decoder/layer/mlp/router/weight"
    difference = helpers.flat(grads)[router] - helpers.flat(lm_grads)[router]
    assert np.max(np.abs(difference)) > 1e-2 * np.max(np.abs(helpers.flat(grads)[router]))


def test_the_dropped_fraction_reported_is_the_one_the_routing_implies():
    """capacity_factor 0.5 on data 2 x expert 4 (one row, 16 tokens, per device): the fraction
    reported for each layer equals the one counted here from the router's choices (each row
    alone on one device, the same params) with the capacity rule written out:
    C = ceil(0.5 x 16 x 2 / 8) = 2 slots per expert per device. (The count past C does not
    depend on the queue's order; tests/modules/layers/test_moe.py checks which assignments
    are dropped.)"""
    moe = _moe(capacity_factor=0.5)
    moe.klass = RecordingMoE
    engine = _engine({"data": 2, "expert": 4}, moe=moe)
    engine.init_state()
    params = jax.device_get(engine.canonical_params())
    batch = BATCHES[0]
    rows, length = batch["input_ids"].shape
    groups = 8
    tokens = rows * length // groups
    # Each device's row alone through the model on one device: its token group, so its drops
    # in one layer shape the next layer's inputs as they do on the mesh.
    one_device = Decoder.default_config().set(**MODEL, moe=moe).instantiate()
    choices = np.concatenate([np.asarray(functional(
        one_device, None, params, ({k: v[g:g + 1] for k, v in batch.items()},),
        is_training=False)[1].module_outputs["decoder"]["layer"]["mlp"]["expert_ids"])
        for g in range(groups)], axis=1)
    slots = math.ceil(0.5 * tokens * TOP_K / EXPERTS)
    expected = []
    for layer in range(MODEL["num_layers"]):
        dropped = 0
        for group in range(groups):
            mine = choices[layer, group * tokens:(group + 1) * tokens]
            taken = np.zeros(EXPERTS, int)
            for choice in range(TOP_K):
                for token in range(tokens):
                    expert = mine[token, choice]
                    dropped += taken[expert] >= slots
                    taken[expert] += 1
        expected.append(dropped / (rows * length * TOP_K))
    assert 0.05 < np.mean(expected) < 0.95
    helpers.train(engine, [batch])
    metrics = engine.history[0]
    name = "summaries/decoder/layer/mlp/dropped_fraction"
    for layer, fraction in enumerate(expected):
        assert_close(metrics[f"{name}/layer_{layer}"], fraction, what=f"layer {layer} dropped")
    assert_close(metrics[name], np.mean(expected), what="dropped fraction")


@functools.lru_cache(maxsize=None)
def _collectives(policy=None):
    """The compiled step's collectives: the 2 MoE layers in a scan, data 2 x expert 4."""
    cfg = _engine({"data": 2, "expert": 4}).config.clone()
    cfg.model.unroll_layers = False
    cfg.model.layer_remat_policy = policy
    engine = cfg.instantiate()
    engine.init_state()
    engine.compile(example_batch=BATCHES[0])
    return engine.collectives()


@pytest.mark.usefixtures("float32_numerics")
@pytest.mark.parametrize("policy", [None, "dots_with_no_batch_dims_saveable",
                                    "nothing_saveable"])
def test_each_moe_layer_exchanges_tokens_with_two_all_to_alls_each_way_and_nothing_else(policy):
    """Inside the layer loop: the dispatch and combine all-to-alls over ``expert`` forward and
    their two transposes backward -- no other collective, nothing over ``data``. After it, the
    gradients replicated over the expert axis cross data x expert in one all-reduce, the
    experts' own (split over ``expert``, already summed by the all-to-alls) cross data only, and
    their squared norm (one float) is summed over ``expert``. Under a remat policy the exchanged
    buffers are saved, not recomputed (recomputing would repeat the forward all-to-alls)."""
    ops = _collectives(policy)
    in_loop = [op for op in ops if op.in_loop]
    assert sorted((op.op, op.axes, op.pass_name) for op in in_loop) == sorted(
        [("all-to-all", ("expert",), "forward")] * 2 + [("all-to-all", ("expert",), "backward")] * 2
    ), [(op.op, op.axes, op.pass_name, op.layer) for op in in_loop]
    assert all(op.layer.endswith("mlp") for op in in_loop)
    reductions = sorted((op.op, op.axes, op.bytes) for op in ops
                        if op.layer == "gradient_reduction")
    assert [r[:2] for r in reductions] == [("all-reduce", ("data",)),
                                           ("all-reduce", ("data", "expert")),
                                           ("all-reduce", ("expert",))]
    # The last: the experts' squared gradient norm summed over their ranks (for the global
    # norm), one float.
    assert reductions[-1][2] == 4
    assert not any("data" in op.axes for op in in_loop)


def test_what_expert_parallelism_cannot_split_is_refused():
    with pytest.raises(errors.PlanError, match="4 experts do not split evenly over the 8") as info:
        helpers.train(_engine({"data": 1, "expert": 8}, moe=_moe(num_experts=4, top_k=2)),
                      BATCHES[:1])
    assert info.value.path == "model.moe.num_experts"
    cfg = _engine({"data": 1, "expert": 2}).config.clone()
    cfg.model.moe = None
    with pytest.raises(errors.PlanError, match="no mixture-of-experts layer") as info:
        cfg.instantiate().build()
    assert info.value.path == "plan.expert_parallel"
    with pytest.raises(errors.PlanError, match="balancing losses would not reach") as info:
        _engine({"data": 1, "expert": 2, "pipe": 2}, pipe="gpipe",
                moe=_moe(aux_loss_weight=0.01)).build()
    assert info.value.path == "model.moe.aux_loss_weight"
    moe = _moe()
    moe.router.balance_rate = 0.01
    with pytest.raises(errors.PlanError, match="state update") as info:
        _engine({"data": 1, "pipe": 2}, pipe="1f1b", moe=moe).build()
    assert info.value.path == "model.moe.router.balance_rate"


def test_explain_shows_the_experts_per_rank_and_the_dispatch():
    text = _engine({"data": 2, "expert": 4}).explain()
    assert "expert parallelism over 'expert' (4 devices)" in text
    assert "8 experts, 2 per rank, top-2; capacity: C = ceil(4 x T x 2 / 8)" in text
    text = _engine({"data": 2, "expert": 4}, moe=_moe(dispatch="dropless")).explain()
    assert "dropless, emulated with a slot per token" in text


def test_the_expert_bias_moves_by_small_steps_under_bfloat16_compute():
    """bfloat16 compute with float32 master params: the bias (here 1.003, which bfloat16 holds
    as 1.0: its step near 1 is 2^-7) moves by steps of at most 7e-4 (rate 1e-4 x a shortfall of
    at most E - 1) -- added to the stored float32 value, not to the bfloat16 copy the router
    reads, which would also move it by the copy's rounding, 3e-3."""
    from titanax.train.precision import Precision  # pylint: disable=import-outside-toplevel
    moe = _moe()
    moe.router.balance_rate = 1e-4
    cfg = _engine({"data": 2, "expert": 4}, moe=moe, learner=helpers.sgd(0.1)).config.clone()
    cfg.precision = Precision.default_config().set(bfloat16=True, enable_x32_params=True)
    engine = cfg.instantiate()
    engine.init_state()
    params = jax.device_get(engine.canonical_params())
    bias = params["decoder"]["layer"]["mlp"]["router"]["expert_bias"]
    params["decoder"]["layer"]["mlp"]["router"]["expert_bias"] = np.full_like(bias, 1.003)
    engine.init_state(params=params)
    helpers.train(engine, BATCHES[:1])
    moved = helpers.flat(jax.device_get(engine.canonical_params()))[
        "decoder/layer/mlp/router/expert_bias"] - np.float32(1.003)
    assert moved.dtype == np.float32
    assert 1e-6 < np.max(np.abs(moved)) <= 7e-4 + 1e-6, moved
    assert abs(float(np.sum(moved))) < 1e-6  # Shortfalls against the mean sum to zero.
