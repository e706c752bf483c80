"""LoRA adapters in the decoder (modules/lora.py): where they go and what shape they take, the
model unchanged at the start, and the gradients of A and B against an independent computation
-- the base model run with the merged weight ``W + scale * A B`` written out by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.modules import lora_reference
from tests.numerics import assert_close, parity_floats
from titanax.errors import ConfigError
from titanax.modules import functional, lora
from titanax.modules.lora import A_SUFFIX, B_SUFFIX, LoRA
from titanax.modules.layers.gated_deltanet import GatedDeltaNet
from titanax.modules.layers.latent_attention import MultiHeadLatentAttention
from titanax.modules.models.decoder import Decoder, gpt_config

pytestmark = pytest.mark.usefixtures("float64_numerics")

BASE = dict(name="decoder", vocab_size=64, max_seq_len=16, num_layers=2, model_dim=32,
            hidden_dim=48, num_heads=4, num_kv_heads=2, rope_theta=10000.0)
RANK = 4


def _model():
    return Decoder.default_config().set(**BASE).instantiate()


def _adapted(model, **lora_fields):
    adapters = LoRA.default_config().set(rank=RANK, alpha=8.0, **lora_fields).instantiate()
    specs = adapters.adapter_specs(model.create_parameter_specs_recursively(),
                                   adaptable=model.adaptable_weight_paths())
    return adapters, specs


def _batch():
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, BASE["vocab_size"])
    return {"input_ids": ids, "target_ids": jnp.roll(ids, -1, axis=1)}


def test_adapters_sit_beside_their_weights_with_its_roles_and_everything_else_is_frozen():
    _, specs = _adapted(_model())
    layer = specs["decoder"]["layer"]
    attn, mlp = layer["attn"], layer["mlp"]
    # q [L, d, heads, head_dim]: A over the input, B over the heads.
    assert attn["q_weight" + A_SUFFIX].shape == (2, 32, RANK)
    assert attn["q_weight" + B_SUFFIX].shape == (2, RANK, 4, 8)
    assert attn["k_weight" + B_SUFFIX].shape == (2, RANK, 2, 8)
    # The output projection (a Linear [heads x head_dim, d]).
    assert attn["o"]["weight" + A_SUFFIX].shape == (2, 32, RANK)
    assert attn["o"]["weight" + B_SUFFIX].shape == (2, RANK, 32)
    # gate / up [L, d, 2, hidden]: one adapter each (dimension 2 is neither input nor output).
    assert mlp["gate_up_weight" + A_SUFFIX].shape == (2, 2, 32, RANK)
    assert mlp["gate_up_weight" + B_SUFFIX].shape == (2, 2, RANK, 48)
    assert mlp["down"]["weight" + B_SUFFIX].shape == (2, RANK, 32)
    trainable = {jax.tree_util.keystr(p) for p, s in jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: hasattr(x, "trainable"))[0] if s.trainable}
    assert trainable and all(k.endswith(("_lora_a']", "_lora_b']")) for k in trainable)
    assert len(trainable) == 2 * 6  # q, k, v, o, gate_up, down.


def test_targets_that_match_nothing_or_a_weight_no_layer_adapts_are_refused():
    with pytest.raises(ConfigError, match="matches no adaptable weight"):
        _adapted(_model(), targets=(r"nothing_here$",))
    # A misspelled pattern beside a good one is refused too (v would train nothing).
    with pytest.raises(ConfigError, match=r"'atn/v_weight\$' matches no adaptable weight"):
        _adapted(_model(), targets=(r"attn/q_weight$", r"atn/v_weight$"))
    with pytest.raises(ConfigError, match="does not adapt"):
        _adapted(_model(), targets=(r"token_emb/weight$",))


def _loss(model, params):
    return functional(model, None, params, (_batch(),), is_training=False)[0][0]


def _family(family):
    """A tiny model of ``family`` and the LoRA targets that adapt every weight its layers can."""
    if family == "gpt2":
        return gpt_config(name="decoder", vocab_size=64, max_seq_len=16, num_layers=2,
                          model_dim=32, num_heads=4).instantiate(), lora.DEFAULT_TARGETS
    changes = {}
    if family == "latent":  # DeepSeek-V3's attention: low-rank queries and a shared latent.
        changes = dict(latent_attention=MultiHeadLatentAttention.default_config().set(
            num_heads=4, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6,
            qk_rope_head_dim=4, v_head_dim=5))
    elif family == "delta":  # Qwen 3.5's: a Gated DeltaNet layer, then gated full attention.
        changes = dict(layer_pattern=("linear", "full"), attention_output_gate=True,
                       linear_attention=GatedDeltaNet.default_config().set(
                           num_key_heads=2, num_value_heads=4, key_head_dim=8,
                           value_head_dim=8, chunk_size=8))
    model = Decoder.default_config().set(**BASE, **changes).instantiate()
    return model, lora.DEFAULT_TARGETS + (r"(^|/)attn/(z|a|b)_weight$",) * (family == "delta")


@pytest.mark.parametrize("family", ["llama", "gpt2", "latent", "delta"])
def test_the_model_starts_as_its_base_and_adapter_gradients_equal_the_merged_weights(family):
    model, targets = _family(family)
    adapters, specs = _adapted(model, targets=targets)
    settings = adapters.settings()
    params = parity_floats(model.initialize_parameters_recursively(jax.random.PRNGKey(0),
                                                                   specs=specs))
    base = parity_floats(model.initialize_parameters_recursively(jax.random.PRNGKey(0)))
    with lora.scope(settings):
        start = _loss(model, params)
    # B starts at zero: the same model, bit for bit (each param's key is its path's).
    assert float(start) == float(_loss(model, base))

    # Move every B off zero, then differentiate by the adapters both ways.
    params = lora_reference.with_moved_adapters(params, scale=0.05)

    def factored(p):
        with lora.scope(settings):
            return _loss(model, p)

    def merged(p):
        return _loss(model, lora_reference.merged(p, settings.scale))

    # (Each a compiled program: op by op, every operation of both passes compiles on its own.)
    want, want_grads = jax.jit(jax.value_and_grad(merged))(params)
    got, got_grads = jax.jit(jax.value_and_grad(factored))(params)
    assert abs(float(want) - float(start)) > 1e-4  # The adapters changed the model.
    assert_close(got, want, what="loss")
    pick = lambda g: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda p, x: x if "_lora_" in jax.tree_util.keystr(p) else jnp.zeros(()), g)
    assert_close(pick(got_grads), pick(want_grads), what="adapter gradients")


def test_disabled_runs_the_base_weights():
    model = _model()
    adapters, specs = _adapted(model)
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(0), specs=specs)
    params = lora_reference.with_moved_adapters(params, scale=0.1)
    base = model.initialize_parameters_recursively(jax.random.PRNGKey(0))
    with lora.disabled():
        off = _loss(model, params)
    with lora.scope(adapters.settings()):
        on = _loss(model, params)
    assert float(off) == float(_loss(model, base)) != float(on)


def test_rslora_scales_by_the_square_root_of_the_rank():
    assert LoRA.default_config().set(rank=16, alpha=8.0).instantiate().scale == 0.5
    assert LoRA.default_config().set(rank=16, alpha=8.0, rslora=True).instantiate().scale == 2.0
    assert np.isclose(LoRA.default_config().set(rank=4, alpha=8.0).instantiate().scale, 2.0)


def test_a_mixture_of_experts_adapts_its_attention_and_refuses_expert_targets():
    """The default targets pass over the experts (their layer does not add an update); a
    pattern naming them is refused."""
    from titanax.modules.layers.moe import MoE
    model = Decoder.default_config().set(
        **BASE, moe=MoE.default_config().set(num_experts=4, top_k=2, hidden_dim=16)).instantiate()
    _, specs = _adapted(model)
    layer = specs["decoder"]["layer"]
    assert "q_weight" + A_SUFFIX in layer["attn"]
    assert not any(lora.is_adapter(name) for name in layer["mlp"])
    with pytest.raises(ConfigError, match="does not adapt"):
        _adapted(model, targets=(r"mlp/gate_up_weight$",))


def _saved_activations(use_lora: bool):
    """Shapes of what the backward keeps of the forward (not params, not constants) under a
    remat policy that saves dot outputs."""
    import contextlib  # pylint: disable=import-outside-toplevel
    import io  # pylint: disable=import-outside-toplevel
    from jax.ad_checkpoint import print_saved_residuals  # pylint: disable=import-outside-toplevel
    from titanax.train.trainable import Trainable  # pylint: disable=import-outside-toplevel
    model = Decoder.default_config().set(
        **BASE, layer_remat_policy="dots_with_no_batch_dims_saveable",
        unroll_layers=False).instantiate()
    adapters = LoRA.default_config().set(rank=RANK).instantiate()
    specs = model.create_parameter_specs_recursively()
    if use_lora:
        specs = adapters.adapter_specs(specs, adaptable=model.adaptable_weight_paths())
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(0), specs=specs)
    trainable = Trainable.from_specs(specs, is_leaf=lambda x: hasattr(x, "trainable"))

    def loss(trained):
        with lora.scope(adapters.settings()):
            return functional(model, jax.random.PRNGKey(1), trainable.merge(params, trained),
                              (_batch(),), is_training=True)[0][0]

    printed = io.StringIO()  # (jax's public view of them is this printout: "f32[2,16] <why>".)
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(loss, trainable.select(params))
    lines = [line.split(" ", 1) for line in printed.getvalue().splitlines() if line.strip()]
    assert lines, "jax printed no residuals"
    return sorted(shape for shape, why in lines
                  if not why.startswith(("from the argument", "from a constant")))


def test_the_adapters_add_no_saved_activation():
    """Their updates (each the size of its weight's output) are recomputed in the backward,
    never kept: what is saved is what training every weight saves, less what the frozen
    embedding's and head's gradients would have needed."""
    import collections  # pylint: disable=import-outside-toplevel
    extra = collections.Counter(_saved_activations(True)) - collections.Counter(
        _saved_activations(False))
    assert not extra, extra
