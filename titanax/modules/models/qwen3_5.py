"""Qwen 3.5's configuration of the decoder family (its dense language model), at published sizes.

Three Gated DeltaNet layers (linear attention: a short causal convolution, the gated delta rule,
a gated norm) then one full attention layer whose heads are gated by a sigmoid of a second query
projection and rotated over a quarter of their width; QK-norm; zero-centered RMSNorms; a SwiGLU
MLP. The multimodal checkpoints' vision tower and MTP head are not part of it.
"""

from __future__ import annotations

from titanax.modules.layers.gated_deltanet import GatedDeltaNet
from titanax.modules.models.decoder import Decoder

# The layer pattern of every published size: three linear-attention layers, then a full one.
QWEN3_5_PATTERN = ("linear",) * 3 + ("full",)


def qwen3_5_config(size: str, **overrides) -> Decoder.Config:
    """Published Qwen 3.5 dense sizes (their language models, as their config.json's
    text_config gives them): "27b"."""
    shapes = {
        # layers, width, heads, kv heads, hidden, linear key / value heads, tied
        "27b": (64, 5120, 24, 4, 17408, 16, 48, False),
    }
    if size not in shapes:
        raise ValueError(f"unknown Qwen 3.5 size {size!r}; one of {', '.join(shapes)}")
    layers, width, heads, kv, hidden, key_heads, value_heads, tied = shapes[size]
    linear = GatedDeltaNet.default_config().set(
        num_key_heads=key_heads, num_value_heads=value_heads, key_head_dim=128,
        value_head_dim=128, conv_kernel_size=4, norm_eps=1e-6)
    return Decoder.default_config().set(
        name="qwen3_5", vocab_size=248320, max_seq_len=262144, num_layers=layers,
        model_dim=width, num_heads=heads, num_kv_heads=kv, head_dim=256, hidden_dim=hidden,
        norm_eps=1e-6, qk_norm=True, norm_zero_centered=True, attention_output_gate=True,
        rotary_fraction=0.25, rope_theta=10000000.0, layer_pattern=QWEN3_5_PATTERN,
        linear_attention=linear, tie_embeddings=tied).set(**overrides)
