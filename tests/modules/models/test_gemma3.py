"""Gemma 3's configs as published read as transformers reads them, and as ``gemma3_config``'s
sizes say (the logits of its tiny models against transformers' are tests/hf/)."""

import pytest

from titanax.hf.model_configs import model_config_from_hf
from titanax.hf.model_dir import language_model_config
from titanax.modules.models.decoder import layer_kinds
from titanax.modules.models.gemma3 import gemma3_config

# google/gemma-3-1b-it's config.json as published (transformers 4.50: the flat RoPE keys).
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
    "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144}

# google/gemma-3-4b-it's: multimodal, its text_config only what differs from the defaults.
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


def _theirs(config):
    """transformers' reading: the text config's sizes, every layer's type, each kind's RoPE."""
    from transformers import Gemma3Config, Gemma3TextConfig  # pylint: disable=import-outside-toplevel
    text = (Gemma3Config(**config).text_config if config["model_type"] == "gemma3"
            else Gemma3TextConfig(**config))
    rope = text.rope_parameters
    return {"num_layers": text.num_hidden_layers, "model_dim": text.hidden_size,
            "num_heads": text.num_attention_heads, "num_kv_heads": text.num_key_value_heads,
            "head_dim": text.head_dim, "hidden_dim": text.intermediate_size,
            "vocab_size": text.vocab_size, "max_seq_len": text.max_position_embeddings,
            "sliding_window": text.sliding_window,
            "kinds": tuple("full" if t == "full_attention" else "sliding"
                           for t in text.layer_types),
            "rope_theta": rope["full_attention"]["rope_theta"],
            "sliding_rope_theta": rope["sliding_attention"]["rope_theta"],
            "factor": rope["full_attention"].get("factor"),
            "attention_scale": text.query_pre_attn_scalar ** -0.5}


def _ours(cfg):
    return {"num_layers": cfg.num_layers, "model_dim": cfg.model_dim, "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "hidden_dim": cfg.hidden_dim, "vocab_size": cfg.vocab_size,
            "max_seq_len": cfg.max_seq_len, "sliding_window": cfg.sliding_window,
            "kinds": layer_kinds(cfg), "rope_theta": cfg.rope_theta,
            "sliding_rope_theta": cfg.sliding_rope_theta,
            "factor": None if cfg.rope_scaling is None else cfg.rope_scaling.factor,
            "attention_scale": cfg.attention_scale or cfg.head_dim ** -0.5}


@pytest.mark.parametrize("name,config,size", [
    ("1b as published", GEMMA3_1B, "1b"),
    ("4b as published (multimodal)", GEMMA3_4B, "4b")])
def test_published_configs_read_as_transformers_reads_them(name, config, size):
    pytest.importorskip("transformers")
    text = (language_model_config(config, where="config.json")
            if config["model_type"] == "gemma3" else config)
    ours = model_config_from_hf(text)
    assert _ours(ours) == _theirs(config), name
    # The published sizes Titanax writes out are these.
    assert ours.clone(name="gemma3").debug_string() == gemma3_config(size).debug_string()
    assert text["eos_token_id"] == [1, 106]  # (A multimodal one's, from the top level.)


def test_a_config_transformers_5_saved_again_reads_alike():
    """transformers 5 writes the pattern as ``_sliding_window_pattern`` beside the per-kind
    ``rope_parameters`` (and keeps what it read): read, not refused as unknown."""
    from transformers import Gemma3TextConfig  # pylint: disable=import-outside-toplevel
    saved = Gemma3TextConfig.from_dict(dict(GEMMA3_1B)).to_dict()
    assert "_sliding_window_pattern" in saved and "full_attention" in saved["rope_parameters"]
    assert model_config_from_hf(saved).debug_string() == \
        model_config_from_hf(GEMMA3_1B).debug_string()
