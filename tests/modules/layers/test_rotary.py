"""RoPE's frequency rescalings against transformers' own (``modeling_rope_utils``), and a
YaRN-scaled model's logits against transformers' through the HF import and export."""

import numpy as np
import pytest

from tests.numerics import CROSS_FRAMEWORK, assert_close
from titanax.modules.layers import rotary

# YaRN as gpt-oss sets it (no truncation), as DeepSeek-V3 does (mscale over mscale_all_dim),
# and as a long-context Qwen does (the defaults).
YARNS = {
    "gpt_oss": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "original_max_position_embeddings": 4096, "truncate": False,
                "rope_theta": 150000.0},
    "deepseek_v3": {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                    "mscale": 1.0, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                    "rope_theta": 10000.0},
    "qwen": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
             "rope_theta": 1000000.0},
}


def _ours(params, head_dim):
    fields = {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")}
    scaling = rotary.YarnRopeScaling.default_config().set(**fields).instantiate()
    return (rotary.inverse_frequencies(head_dim, params["rope_theta"], scaling),
            rotary.attention_scaling(scaling))


@pytest.mark.parametrize("name", sorted(YARNS))
def test_yarn_frequencies_and_factor_are_transformers(name):
    from transformers import Qwen3Config  # pylint: disable=import-outside-toplevel
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # pylint: disable=import-outside-toplevel
    params = YARNS[name]
    config = Qwen3Config(hidden_size=256, num_attention_heads=4, head_dim=64,
                         max_position_embeddings=131072, rope_parameters=dict(params))
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    inv_freq, magnitude = _ours(params, 64)
    # To float32's last bits (torch's pow and numpy's may round one power differently).
    np.testing.assert_allclose(inv_freq, theirs.numpy(), rtol=4e-7, atol=0)
    assert magnitude == pytest.approx(factor, rel=1e-12) and magnitude != 1.0


@pytest.mark.parametrize("name", ["gpt_oss", "deepseek_v3"])
def test_a_yarn_scaled_model_is_transformers_in_and_out(name, tmp_path):
    """A tiny Qwen 3 with YaRN (a short original context, so both ends of the ramp occur in 16
    positions): imported, its logits are transformers'; exported, transformers reads the same
    scaling back."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from tests.hf import reference_models as ref
    from titanax.hf import exporter, importer
    from titanax.modules.module import functional
    params = {**YARNS[name], "original_max_position_embeddings": 8, "factor": 4.0}
    torch.manual_seed(0)
    source = str(tmp_path / "source")
    Qwen3ForCausalLM(Qwen3Config(
        vocab_size=ref.VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        initializer_range=0.3, rope_parameters=params)).save_pretrained(source)
    cfg = importer.model_config(source)
    assert isinstance(cfg.rope_scaling, rotary.YarnRopeScaling.Config)
    weights = importer.params_as_numpy(source, cfg)
    ids = ref.token_ids()
    logits, _ = functional(cfg.instantiate(), None, weights, (ids,), method="logits",
                           is_training=False)
    assert_close(np.asarray(logits), ref.hf_logits(source, ids), bound=CROSS_FRAMEWORK,
                 what=f"{name} YaRN logits")
    plain = cfg.clone(rope_scaling=None)
    unscaled, _ = functional(plain.instantiate(), None, weights, (ids,), method="logits",
                             is_training=False)
    assert np.abs(np.asarray(unscaled) - np.asarray(logits)).max() > 1e-2  # (It matters here.)
    out = exporter.export_params(weights, model_cfg=cfg, directory=str(tmp_path / "out"),
                                 source_dir=source)
    assert importer.model_config(out).debug_string() == cfg.debug_string()
    assert_close(ref.hf_logits(out, ids), ref.hf_logits(source, ids), bound=CROSS_FRAMEWORK,
                 what="the export's logits")
