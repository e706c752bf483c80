"""The mixture-of-experts layer and its router against numpy written out token by token."""

import math

import jax
import numpy as np
import pytest

from tests.numerics import assert_close
from titanax.modules import functional
from titanax.modules.layers import expert_dispatch
from titanax.modules.layers.moe import MoE, add_moe_objective

RNG = np.random.default_rng(0)
WIDTH, HIDDEN, EXPERTS, TOP_K = 16, 8, 8, 2


def _layer(*, router_scale=20.0, **changes):
    router = changes.pop("router", {})
    changes.setdefault("capacity_factor", EXPERTS / TOP_K)  # Nothing drops unless asked to.
    cfg = MoE.default_config().set(name="moe", model_dim=WIDTH, hidden_dim=HIDDEN,
                                   num_experts=EXPERTS, top_k=TOP_K).set(**changes)
    cfg.router.set(**router)
    layer = cfg.instantiate()
    params = layer.initialize_parameters_recursively(jax.random.PRNGKey(1))
    # Wide router logits: the choices and gates differ clearly between tokens; experts whose
    # outputs are not lost in rounding.
    params["router"]["weight"] = params["router"]["weight"] * router_scale
    for name in params:
        if name != "router":
            params[name] = params[name] * 10
    return layer, params


def _silu(x):
    return x / (1 + np.exp(-x))


def _reference(params, x, *, scoring="softmax", normalize=True, scaling=1.0, slots=None,
               bias=None, valid=None):
    """Token by token: the router's choice, then each chosen expert's SwiGLU; with ``slots``
    an expert takes at most that many of the (choice-major) queue; ``valid`` (0: padding) skips
    tokens, which then take no slot. Returns the output and the dropped fraction of the real
    tokens' assignments."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    tokens = np.asarray(x, np.float64).reshape(-1, WIDTH)
    logits = tokens @ p["router"]["weight"]
    if scoring == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    choosing = scores + (bias if bias is not None else 0)
    chosen = np.argsort(-choosing, axis=-1, kind="stable")[:, :TOP_K]
    gates = np.take_along_axis(scores, chosen, -1)
    if normalize or scoring == "sigmoid":
        gates /= gates.sum(-1, keepdims=True)
    gates *= scaling
    real = np.ones(len(tokens), bool) if valid is None else np.asarray(valid, bool)
    kept = np.repeat(real[:, None], TOP_K, axis=1)
    if slots is not None:
        taken = np.zeros(EXPERTS, int)
        for choice in range(TOP_K):
            for t in np.flatnonzero(real):
                kept[t, choice] = taken[chosen[t, choice]] < slots
                taken[chosen[t, choice]] += 1
    out = np.zeros_like(tokens)
    for t, token in enumerate(tokens):
        for choice in range(TOP_K):
            if kept[t, choice]:
                e = chosen[t, choice]
                both = np.einsum("d,dsf->sf", token, p["gate_up_weight"][e])
                out[t] += gates[t, choice] * (_silu(both[0]) * both[1]) @ p["down_weight"][e]
    if "shared_gate_up_weight" in p:
        both = np.einsum("td,dsf->tsf", tokens, p["shared_gate_up_weight"])
        out += (_silu(both[:, 0]) * both[:, 1]) @ p["shared_down_weight"]
    return out.reshape(np.shape(x)), 1 - kept[real].mean()


def _run(layer, params, x):
    out, collection = functional(layer, None, params, (x,), is_training=False)
    return np.asarray(out), collection.summaries


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_routed_experts_equal_each_token_through_its_chosen_experts(dispatch):
    """Capacity E / top_k (never drops) and dropless (ragged_dot) are the same model."""
    layer, params = _layer(dispatch=dispatch)
    x = RNG.normal(size=(2, 6, WIDTH)).astype(np.float32)
    out, summaries = _run(layer, params, x)
    want, _ = _reference(params, x)
    assert np.std(want) > 0.01
    assert_close(out, want, what=f"{dispatch} output")
    assert float(summaries["dropped_fraction"]) == 0.0


def test_sigmoid_scores_scaled_gates_and_a_shared_expert():
    """DeepSeek-V3's router (sigmoid scores, normalised, scaled) and a shared expert."""
    # (Moderate logits: saturated sigmoids would tie in float32.)
    layer, params = _layer(shared_hidden_dim=12, router_scale=3.0,
                           router=dict(scoring="sigmoid", routed_scaling=2.5))
    x = RNG.normal(size=(3, 5, WIDTH)).astype(np.float32)
    out, _ = _run(layer, params, x)
    want, _ = _reference(params, x, scoring="sigmoid", scaling=2.5)
    assert_close(out, want, what="output")


def test_unnormalised_softmax_gates():
    """Qwen 3 MoE with norm_topk_prob=False: the gates are the plain probabilities."""
    layer, params = _layer(router=dict(normalize_top_k=False))
    x = RNG.normal(size=(2, 4, WIDTH)).astype(np.float32)
    assert_close(_run(layer, params, x)[0], _reference(params, x, normalize=False)[0],
                 what="output")


@pytest.mark.parametrize("factor", [0.25, 0.5, 1.0])
def test_capacity_drops_the_queue_past_each_experts_slots(factor):
    """Tokens past an expert's C = ceil(factor x T x top_k / E) slots lose that expert; first
    choices queue before second ones; the dropped fraction is reported."""
    layer, params = _layer(capacity_factor=factor)
    x = RNG.normal(size=(4, 8, WIDTH)).astype(np.float32)
    slots = math.ceil(factor * 32 * TOP_K / EXPERTS)
    out, summaries = _run(layer, params, x)
    want, dropped = _reference(params, x, slots=slots)
    assert dropped > 0
    assert_close(out, want, what="output")
    assert_close(float(summaries["dropped_fraction"]), dropped, what="dropped fraction")


def test_slot_positions_queue_first_choices_before_second_ones():
    ids = np.array([[0, 1], [0, 2], [1, 0], [2, 0]], np.int32)
    positions = np.asarray(expert_dispatch.slot_positions(ids, 3, valid=np.ones(4), slots=9))
    # Expert 0: tokens 0, 1 (first choices), then 2, 3 (second choices).
    assert positions.tolist() == [[0, 1], [1, 1], [0, 2], [0, 3]]
    # Token 1 padding: out of every queue (at the slot count), the others move up.
    positions = expert_dispatch.slot_positions(ids, 3, valid=np.array([1, 0, 1, 1]), slots=9)
    assert np.asarray(positions).tolist() == [[0, 1], [9, 9], [0, 1], [0, 2]]
    assert expert_dispatch.capacity(tokens=10, top_k=2, num_experts=8, factor=100.0) == 10
    assert expert_dispatch.capacity(tokens=10, top_k=2, num_experts=8, factor=0.01) == 1


def test_balancing_and_z_losses_and_the_load_summaries_match_their_formulas():
    """HF's load-balancing loss E x sum_i (assignments_i / T) x mean_t p_ti, the z-loss
    mean_t logsumexp(logits_t)^2, and each expert's load over the mean."""
    layer, params = _layer()
    x = RNG.normal(size=(2, 8, WIDTH)).astype(np.float32)
    _, summaries = _run(layer, params, x)
    tokens = x.reshape(-1, WIDTH).astype(np.float64)
    logits = tokens @ np.asarray(params["router"]["weight"], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1)[:, :TOP_K]
    counts = np.bincount(chosen.ravel(), minlength=EXPERTS)
    aux = EXPERTS * np.sum(counts / len(tokens) * probs.mean(0))
    z = np.mean((np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
                 + logits.max(-1)) ** 2)
    load = counts / counts.mean()
    assert_close(float(summaries["aux_loss"]), aux, what="aux loss")
    assert_close(float(summaries["z_loss"]), z, what="z loss")
    assert_close(np.asarray(summaries["expert_load"].value), load, what="load per expert")
    assert_close(float(summaries["group_load_max"]), load.max(), what="max load")


def _steered(router):
    """``(layer, params, x, collection, output)``: a layer with ``router``'s settings and an
    expert bias, run for training on ``x``, its output checked against the reference's with
    that bias."""
    layer, params = _layer(router=router)
    bias = np.linspace(-0.5, 0.5, EXPERTS).astype(np.float32)
    params["router"]["expert_bias"] = bias
    x = RNG.normal(size=(2, 8, WIDTH)).astype(np.float32)
    out, collection = functional(layer, None, params, (x,), is_training=True)
    want, _ = _reference(params, x, bias=bias)
    assert_close(np.asarray(out), want, what="output with the bias")
    return layer, params, x, collection, want


def test_the_expert_bias_steers_choices_and_moves_towards_balance():
    """Aux-loss-free balancing: the bias changes which experts are chosen, never the gates'
    values; a training call moves it by the rate times each expert's shortfall against the mean
    load (up for the under-loaded experts)."""
    layer, params, x, collection, _ = _steered(dict(balance_rate=0.1))
    bias = params["router"]["expert_bias"]
    # An increment, added to the stored bias (not to the compute-dtype copy the layer read).
    step = np.asarray(collection.state_updates["router"]["expert_bias"].value)
    tokens = x.reshape(-1, WIDTH).astype(np.float64)
    logits = tokens @ np.asarray(params["router"]["weight"], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    counts = np.bincount(np.argsort(-(probs + bias), -1)[:, :TOP_K].ravel(), minlength=EXPERTS)
    assert_close(step, 0.1 * (1 - counts / counts.mean()), what="bias step")


def test_a_fixed_choosing_bias_steers_choices_and_is_neither_moved_nor_decayed():
    """``choosing_bias`` without balancing (DeepSeek-V3's ``e_score_correction_bias`` when
    fine-tuning): the same choices as the balancing bias, no update written and no weight
    decay (it reaches only the choice of experts: no gradient either)."""
    layer, params, x, collection, want = _steered(dict(choosing_bias=True))
    assert not collection.state_updates.get("router")
    spec = layer.create_parameter_specs_recursively()["router"]["expert_bias"]
    assert spec.weight_decay_scale == 0
    without, _ = _reference(params, x)
    assert not np.allclose(want, without), "a bias that changes no choice proves little"


def test_the_moe_objective_joins_the_gradient_not_the_value():
    loss = jax.numpy.float32(2.0)

    def total(w):
        return add_moe_objective(loss * w, {"decoder": {"moe_objective": 3.0 * w * w}})

    value, grad = jax.value_and_grad(total)(1.5)
    assert float(value) == 3.0  # loss x w only
    assert_close(float(grad), 2.0 + 6.0 * 1.5, what="gradient")


def test_flops_count_the_active_experts_only():
    """6 x the params a token multiplies by: the dense ones, and top_k of the E experts."""
    from titanax.modules.models.decoder import Decoder  # pylint: disable=import-outside-toplevel
    moe = MoE.default_config().set(hidden_dim=24, num_experts=8, top_k=2)
    model = Decoder.default_config().set(
        name="m", vocab_size=100, num_layers=3, model_dim=32, num_heads=4, num_kv_heads=2,
        hidden_dim=64, moe=moe).instantiate()
    dense = Decoder.default_config().set(
        name="m", vocab_size=100, num_layers=3, model_dim=32, num_heads=4, num_kv_heads=2,
        hidden_dim=2 * 24).instantiate()
    # The same model with one dense SwiGLU of 2 experts' width per layer, plus the router.
    router = 3 * 32 * 8
    assert model.flops_per_token(16) == dense.flops_per_token(16) + 6 * router


@pytest.mark.parametrize("changes,path,message", [
    (dict(capacity_factor=float("nan")), "capacity_factor", "expected a number, got nan"),
    (dict(capacity_factor=float("inf")), "capacity_factor", "finite number > 0"),
    (dict(top_k=9), "top_k", "must be <= num_experts=8"),
    (dict(hidden_dim=0), "hidden_dim", "must be >= 1"),
    (dict(router=dict(balance_rate=1.5)), "balance_rate", r"must be in \[0, 1\]"),
    (dict(router=dict(balance_rate=-0.1)), "balance_rate", r"must be in \[0, 1\]"),
])
def test_bad_moe_settings_are_named(changes, path, message):
    from titanax import errors  # pylint: disable=import-outside-toplevel
    with pytest.raises(errors.ConfigError, match=message) as info:  # (NaN: on assignment.)
        _layer(**changes)
    assert path in str(info.value)


def test_a_decoder_refuses_mlp_biases_it_would_not_have():
    from titanax import errors  # pylint: disable=import-outside-toplevel
    from titanax.modules.models.decoder import Decoder  # pylint: disable=import-outside-toplevel
    cfg = Decoder.default_config().set(name="m", num_layers=1, model_dim=16, num_heads=2,
                                       mlp_bias=True, moe=MoE.default_config().set(hidden_dim=8))
    with pytest.raises(errors.ConfigValidationError, match="mlp_bias: a mixture of experts"):
        cfg.instantiate()


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_padding_tokens_are_not_routed(dispatch):
    """Packed rows' padding (segment id 0): no slot, no output, no count in the load, the
    dropped fraction or the balancing losses -- a real token's routing is what it would be
    without the padding around it."""
    layer, params = _layer(dispatch=dispatch, capacity_factor=0.75)
    x = RNG.normal(size=(2, 8, WIDTH)).astype(np.float32)
    segments = np.array([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]], np.int32)
    out, collection = functional(layer, None, params, {"x": x, "segment_ids": segments},
                                 is_training=False)
    summaries = collection.summaries
    real = segments.reshape(-1) != 0
    slots = None if dispatch == "dropless" else math.ceil(0.75 * 16 * TOP_K / EXPERTS)
    want, dropped = _reference(params, x, slots=slots, valid=real)
    assert_close(np.asarray(out), want, what="output")
    assert np.all(np.asarray(out).reshape(-1, WIDTH)[~real] == 0)
    assert_close(float(summaries["dropped_fraction"]), dropped, what="dropped fraction")
    if dispatch == "capacity":
        assert dropped > 0
    tokens = x.reshape(-1, WIDTH)[real].astype(np.float64)
    logits = tokens @ np.asarray(params["router"]["weight"], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    counts = np.bincount(np.argsort(-probs, -1)[:, :TOP_K].ravel(), minlength=EXPERTS)
    assert_close(np.asarray(summaries["expert_load"].value), counts / counts.mean(),
                 what="load of the real tokens")
    aux = EXPERTS * np.sum(counts / len(tokens) * probs.mean(0))
    assert_close(float(summaries["aux_loss"]), aux, what="aux loss of the real tokens")


def test_group_limited_routing_is_deepseek_v3s():
    """Sigmoid scores plus the choosing bias, experts in 4 groups of which each token may use 2
    (a group scored by its best two), top 3, renormalised and scaled: transformers'
    DeepseekV3TopkRouter's experts and gates, token for token."""
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from titanax.modules.layers.router import Router
    router = Router.default_config().set(
        name="router", model_dim=16, num_experts=16, top_k=3, scoring="sigmoid",
        routed_scaling=2.5, balance_rate=0.001, num_groups=4, top_groups=2).instantiate()
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(16, 16)).astype(np.float32)
    bias = (rng.normal(size=(16,)) * 0.3).astype(np.float32)
    tokens = rng.normal(size=(40, 16)).astype(np.float32)
    routing, _ = functional(router, None, {"weight": weight, "expert_bias": bias},
                            (tokens,), is_training=False)
    theirs = DeepseekV3TopkRouter(DeepseekV3Config(
        hidden_size=16, n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5))
    theirs.weight.data = torch.tensor(weight.T)
    theirs.e_score_correction_bias.data = torch.tensor(bias)
    with torch.no_grad():
        _, gates, ids = theirs(torch.tensor(tokens))
    order = np.argsort(ids.numpy(), axis=-1)
    ours_order = np.argsort(np.asarray(routing.expert_ids), axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(routing.expert_ids), ours_order, -1),
                                  np.take_along_axis(ids.numpy(), order, -1))
    assert_close(np.take_along_axis(np.asarray(routing.gates), ours_order, -1),
                 np.take_along_axis(gates.numpy(), order, -1), what="gates")
    # Groups matter here: without them some token takes another expert.
    free = router.config.clone(num_groups=1, top_groups=None).instantiate()
    unlimited, _ = functional(free, None, {"weight": weight, "expert_bias": bias}, (tokens,),
                              is_training=False)
    assert not np.array_equal(np.sort(np.asarray(unlimited.expert_ids), -1),
                              np.sort(np.asarray(routing.expert_ids), -1))
