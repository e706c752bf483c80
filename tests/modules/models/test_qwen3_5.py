"""Qwen 3.5's text model as a configuration of the decoder: three Gated DeltaNet layers then a
gated full attention (partial RoPE, QK-norm), zero-centered RMSNorms -- transformers'
Qwen3_5ForCausalLM's logits from the same weights, mapped here by hand layer by layer -- a
check of the model apart from titanax.hf's param map, which tests/hf/test_import.py checks on
the same reference."""

import jax
import numpy as np
import pytest

from titanax.modules.layers.gated_deltanet import GatedDeltaNet
from titanax.modules.models.decoder import Decoder
from titanax.modules.module import functional
from tests.hf import reference_models as ref
from tests.numerics import CROSS_FRAMEWORK, assert_close

VOCAB, WIDTH, LAYERS, HEADS, KV, HEAD_DIM, HIDDEN = 96, 64, 8, 4, 2, 16, 96
LINEAR = dict(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8)
KINDS = ["linear_attention"] * 3 + ["full_attention"]  # (The reference's pattern, twice.)


def _hf_model():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    return ref.BUILDERS["qwen3_5"]().eval()


def _titanax_config():
    return Decoder.default_config().set(
        name="qwen3_5", vocab_size=VOCAB, max_seq_len=64, num_layers=LAYERS, model_dim=WIDTH,
        num_heads=HEADS, num_kv_heads=KV, head_dim=HEAD_DIM, hidden_dim=HIDDEN, norm_eps=1e-6,
        rope_theta=10000.0, qk_norm=True, norm_zero_centered=True, attention_output_gate=True,
        rotary_fraction=0.25, layer_pattern=("linear", "linear", "linear", "full"),
        linear_attention=GatedDeltaNet.default_config().set(**LINEAR), tie_embeddings=False)


def _heads(weight, heads, width):
    """An HF ``[heads * width, d]`` projection as Titanax's ``[d, heads, width]``."""
    return weight.T.reshape(weight.shape[1], heads, width)


def _linear_attention(t, pre):
    rows = {"q": (0, 16), "k": (16, 32), "v": (32, 64)}
    out = {"z_weight": _heads(t[pre + "in_proj_z.weight"], 4, 8),
           "a_weight": t[pre + "in_proj_a.weight"].T, "b_weight": t[pre + "in_proj_b.weight"].T,
           "dt_bias": t[pre + "dt_bias"], "a_log": t[pre + "A_log"],
           "norm_scale": t[pre + "norm.weight"], "o": {"weight": t[pre + "out_proj.weight"].T}}
    for name, (start, end) in rows.items():
        heads, width = (2, 8) if name != "v" else (4, 8)
        out[f"{name}_weight"] = _heads(t[pre + "in_proj_qkv.weight"][start:end], heads, width)
        taps = t[pre + "conv1d.weight"][start:end, 0, :]  # [channels, K]
        out[f"{name}_conv"] = taps.T.reshape(taps.shape[1], heads, width)
    return out


def _full_attention(t, pre):
    query_and_gate = t[pre + "q_proj.weight"].T.reshape(WIDTH, HEADS, 2, HEAD_DIM)
    return {"q_weight": query_and_gate[:, :, 0], "gate_weight": query_and_gate[:, :, 1],
            "k_weight": _heads(t[pre + "k_proj.weight"], KV, HEAD_DIM),
            "v_weight": _heads(t[pre + "v_proj.weight"], KV, HEAD_DIM),
            "o": {"weight": t[pre + "o_proj.weight"].T},
            "q_norm": {"scale": t[pre + "q_norm.weight"]},
            "k_norm": {"scale": t[pre + "k_norm.weight"]}}


def _params(model):
    """The HF state dict as the decoder's params: layer g * 4 + m is member m, repetition g."""
    t = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    layers = []
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        attention = (_linear_attention(t, pre + "linear_attn.") if KINDS[i % 4] ==
                     "linear_attention" else _full_attention(t, pre + "self_attn."))
        layers.append({
            "input_norm": {"scale": t[pre + "input_layernorm.weight"]},
            "post_attention_norm": {"scale": t[pre + "post_attention_layernorm.weight"]},
            "attn": attention,
            "mlp": {"gate_up_weight": np.stack([t[pre + "mlp.gate_proj.weight"].T,
                                                t[pre + "mlp.up_proj.weight"].T], axis=1),
                    "down": {"weight": t[pre + "mlp.down_proj.weight"].T}}})
    members = {str(m): jax.tree_util.tree_map(lambda *xs: np.stack(xs), *layers[m::4])
               for m in range(4)}
    return {"token_emb": {"weight": t["model.embed_tokens.weight"]},
            "lm_head": {"weight": t["lm_head.weight"]},
            "final_norm": {"scale": t["model.norm.weight"]},
            "decoder": {"layer": members}}


def test_the_decoder_configured_as_qwen3_5_gives_transformers_logits():
    """Eight layers (two repetitions of the pattern), 20 tokens (Gated DeltaNet chunks of 64:
    one part chunk), float32: transformers' logits within the cross-framework bound; with the
    zero-centered norms or the partial rotation left out, not."""
    torch = pytest.importorskip("torch")
    model = _hf_model()
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 20)).astype(np.int32)
    with torch.no_grad():
        expected = model(torch.tensor(ids, dtype=torch.long)).logits.numpy().astype(np.float64)
    assert np.std(expected) > 0.5, "logits too flat to tell models apart"
    params = _params(model)
    cfg = _titanax_config()
    model_params = jax.tree_util.tree_map(np.shape, cfg.instantiate()
                                          .initialize_parameters_recursively(
                                              jax.random.PRNGKey(0)))
    assert jax.tree_util.tree_map(np.shape, params) == model_params  # (Every param mapped.)
    logits, _ = functional(cfg.instantiate(), None, params, (ids,), method="logits",
                           is_training=False)
    assert_close(np.asarray(logits), expected, bound=CROSS_FRAMEWORK, what="Qwen 3.5 logits")
    for changed in (dict(rotary_fraction=1.0), dict(norm_zero_centered=False)):
        other, _ = functional(cfg.clone(**changed).instantiate(), None, params, (ids,),
                              method="logits", is_training=False)
        assert not np.allclose(np.asarray(other), expected, atol=1e-2), changed


def test_a_config_that_leaves_out_the_defaults_reads_as_transformers_reads_it():
    """No ``partial_rotary_factor`` and no ``layer_types`` (full_attention_interval's): what
    transformers fills in -- a quarter of each head rotated, every 4th layer full -- not whole
    heads or a refusal."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import (  # pylint: disable=import-outside-toplevel
        Qwen3_5TextConfig)
    from titanax.hf.model_configs import model_config_from_hf  # pylint: disable=import-outside-toplevel
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    config = ref.BUILDERS["qwen3_5"]().config.to_dict()
    config["rope_parameters"].pop("partial_rotary_factor")
    config.pop("layer_types")
    theirs = Qwen3_5TextConfig(**config)
    ours = model_config_from_hf(config)
    assert ours.rotary_fraction == theirs.rope_parameters["partial_rotary_factor"] == 0.25
    assert ours.layer_pattern == ("linear", "linear", "linear", "full")
    assert list(theirs.layer_types) == ["linear_attention"] * 3 + ["full_attention"] + \
        ["linear_attention"] * 3 + ["full_attention"]
