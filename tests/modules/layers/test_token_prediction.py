"""Multi-token prediction (DeepSeek-V3's MTP) against the formula written out here, in float64:
each depth's reported loss, the reported loss (the next-token one), and the gradient of
``L_main + weight / D x sum_k L_k`` -- on packed rows with a padded token, so the document and
row boundaries and the weights are part of what is checked."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from titanax import errors
from titanax.modules import functional
from titanax.modules.layers.moe import MoE
from titanax.modules.models.decoder import Decoder
from titanax.parallel import axis_binding
from tests.numerics import assert_close

pytestmark = pytest.mark.usefixtures("float64_numerics")

VOCAB, LENGTH, DEPTHS, WEIGHT = 37, 10, 2, 0.3


def _model(**changes):
    return Decoder.default_config().set(
        name="mtp", dtype="float64", vocab_size=VOCAB, max_seq_len=16, num_layers=2,
        model_dim=16, num_heads=2, hidden_dim=24, norm_eps=1e-6, mtp_depths=DEPTHS,
        mtp_loss_weight=WEIGHT, **changes).instantiate()


def _batch():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, VOCAB, (2, LENGTH + 1))
    segments = np.array([[1] * 6 + [2] * 4, [1] * 9 + [0]])  # Two documents; a padded token.
    positions = np.concatenate([np.arange(6), np.arange(4)])[None].repeat(2, 0)
    positions[1] = np.arange(LENGTH)
    weights = (segments > 0).astype(np.float64)
    weights[0, 3] = 0.0  # (A target the loss skips.)
    return {"input_ids": jnp.asarray(ids[:, :-1]), "target_ids": jnp.asarray(ids[:, 1:]),
            "segment_ids": jnp.asarray(segments), "positions": jnp.asarray(positions),
            "weights": jnp.asarray(weights)}


def _rms(x, scale, eps=1e-6):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _cross_entropy(hidden, table, targets):
    """Per token, ``-log softmax(hidden @ table.T)[target]`` over the real vocabulary."""
    logits = (hidden @ table.T)[..., :VOCAB]
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]


def _written_out(model, params, batch, *, block_collections=None):
    """``(L_main, [L_1 .. L_D])`` by the formula (module docstring of token_prediction.py): the
    stack and each depth's decoder block run as modules (each is a layer tested on its own),
    the rest -- shifts, norms, projection, head, masks -- by hand. Depth ``k``'s block sees the
    positions without a target ``k`` places on in their document as padding (the paper runs
    the depth on the sequence less its last ``k`` tokens; a counted position attends only to
    positions that have one); its output collection goes to ``block_collections[k]``."""
    docs = {k: batch[k] for k in ("segment_ids", "positions")}
    table, head = params["token_emb"]["weight"], params["lm_head"]["weight"]
    hidden, _ = functional(model.decoder, None, params["decoder"],
                           {"x": table[batch["input_ids"]], **docs}, is_training=True)
    # (As numpy: the masks below are read in Python, also while the formula is traced.)
    weights, segments = np.asarray(batch["weights"]), np.asarray(batch["segment_ids"])

    def mean(per_token, w):
        return jnp.sum(per_token * w) / jnp.sum(w)
    main = mean(_cross_entropy(_rms(hidden, params["final_norm"]["scale"]), head,
                               batch["target_ids"]), weights)
    losses = []
    for k in range(1, DEPTHS + 1):
        depth, p = model.prediction._children[str(k - 1)], params["prediction"][str(k - 1)]
        ahead = jnp.pad(batch["input_ids"][:, k:], ((0, 0), (0, k)))
        joined = jnp.concatenate([_rms(table[ahead], p["embedding_norm"]["scale"]),
                                  _rms(hidden, p["hidden_norm"]["scale"])], axis=-1)
        targets = jnp.pad(batch["target_ids"][:, k:], ((0, 0), (0, k)))
        counted, has_target = np.zeros(weights.shape), np.zeros(weights.shape, bool)
        for row in range(weights.shape[0]):
            for i in range(LENGTH - k):  # Target t_{i+k+1}: in the row, the same document.
                if segments[row, i + k] == segments[row, i]:
                    counted[row, i] = weights[row, i + k]
                    has_target[row, i] = True
        hidden, collection = functional(
            depth.block, None, p["block"], {"x": joined @ p["project"]["weight"], **docs,
                                            "segment_ids": jnp.where(has_target, segments, 0)},
            is_training=True)
        if block_collections is not None:
            block_collections[k] = collection
        # (Over the next-token loss's count, as the paper's 1/T.)
        losses.append(jnp.sum(_cross_entropy(_rms(hidden, p["output_norm"]["scale"]), head,
                                             targets) * counted) / jnp.sum(weights))
    return main, losses


def _random_params(model):
    rng = np.random.default_rng(0)
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(0))
    return jax.tree_util.tree_map(
        lambda p: jnp.asarray(rng.normal(size=p.shape) * 0.3, jnp.float64), params)


@pytest.mark.parametrize("experts", [False, True], ids=["dense", "moe"])
def test_losses_metrics_and_gradient_equal_the_written_formula(experts):
    # (No balancing terms: the formula is MTP's alone.)
    changes = {"moe": MoE.default_config().set(
        hidden_dim=8, num_experts=4, top_k=2, dispatch="dropless", aux_loss_weight=0.0,
        z_loss_weight=0.0)} if experts else {}
    model = _model(**changes)
    params, batch = _random_params(model), _batch()

    def ours(p):
        (loss, _), collection = functional(model, None, p, (batch,), is_training=True)
        return loss, collection.summaries

    # (Each side one compiled program: op by op, every operation of the forward and backward
    # passes would compile on its own.)
    (loss, summaries), grads = jax.jit(jax.value_and_grad(ours, has_aux=True))(params)
    main, losses = jax.jit(lambda p: _written_out(model, p, batch))(params)
    assert_close(loss, main, what="reported loss = the next-token one")
    for k, expected in enumerate(losses, start=1):
        assert_close(summaries[f"metrics/mtp_loss/{k}"], expected, what=f"mtp_loss/{k}")

    def formula(p):
        main, losses = _written_out(model, p, batch)
        return main + WEIGHT / DEPTHS * sum(losses)
    expected = jax.jit(jax.grad(formula))(params)
    assert_close(grads, expected, what="gradient")
    assert float(jnp.max(jnp.abs(grads["prediction"]["1"]["project"]["weight"]))) > 0


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_a_depths_experts_route_only_the_positions_with_a_target(dispatch):
    """Depth k's mixture of experts routes no position whose target k places on lies past its
    row or document: what its balance loss, loads, dropped fraction and choosing bias's step
    count is the written-out block's with those positions as padding (which takes no slot)."""
    moe = MoE.default_config().set(hidden_dim=8, num_experts=4, top_k=2, dispatch=dispatch,
                                   capacity_factor=0.75)
    moe.router.balance_rate = 0.01
    model = _model(moe=moe)
    params, batch = _random_params(model), _batch()
    _, collection = functional(model, None, params, (batch,), is_training=True)
    written = {}
    _written_out(model, params, batch, block_collections=written)
    for k in range(1, DEPTHS + 1):
        for name in ("aux_loss", "expert_load", "dropped_fraction"):  # (Load: per expert.)
            got = _at(collection.summaries, f"prediction/{k - 1}/block/mlp/{name}")
            assert_close(got, _at(written[k].summaries, f"mlp/{name}"),
                         what=f"depth {k}'s {name}")
        step = _at(collection.state_updates, f"prediction/{k - 1}/block/mlp/router/expert_bias")
        assert_close(step, _at(written[k].state_updates, "mlp/router/expert_bias"),
                     what=f"depth {k}'s choosing-bias step")


def _at(tree, path):
    for key in path.split("/"):
        tree = tree[key]
    return getattr(tree, "value", tree)  # (A vector summary's values.)


def test_evaluation_runs_no_depth():
    model = _model()
    params, batch = _random_params(model), _batch()
    (loss, _), collection = functional(model, None, params, (batch,), is_training=False)
    main, _ = _written_out(model, params, batch)
    assert_close(loss, main, what="evaluation loss")
    assert not any(k.startswith("metrics/") for k in collection.summaries)


def test_bad_depths_and_split_sequences_are_refused_by_name():
    with pytest.raises(errors.ConfigError, match="mtp_depths"):
        Decoder.default_config().set(vocab_size=8, mtp_depths=-1).validate()
    with pytest.raises(errors.ConfigError, match="mtp_loss_weight"):
        Decoder.default_config().set(vocab_size=8, mtp_loss_weight=-0.1).validate()
    model = _model()
    binding = axis_binding.AxisBinding(dims=((axis_binding.SEQUENCE, "context"),))
    with pytest.raises(errors.PlanError, match="model.mtp_depths"):
        model.check_axis_binding(binding, path="model")


def test_an_objective_that_does_not_run_the_models_loss_refuses_the_depths():
    """A preference objective scores sequences with the model's primitives: the depths would
    get no gradient, only weight decay, and an export would write them decayed."""
    from titanax.objectives.preference import Preference  # pylint: disable=import-outside-toplevel
    from titanax.train.engine import Engine  # pylint: disable=import-outside-toplevel
    cfg = Engine.default_config().set(
        model=_model().config.clone(dtype=None), objective=Preference.default_config(),
        loggers=[])
    with pytest.raises(errors.ConfigError, match="multi-token-prediction") as raised:
        cfg.instantiate().build()
    assert raised.value.path == "model.mtp_depths"
