"""Gemma 3's configuration of the decoder family, at its published sizes.

Gemma 3 (text): five sliding-window layers then a global one, the sliding ones rotated by plain
RoPE at base 10,000 and the global ones at 1,000,000 (scaled linearly by 8 from 4B up); QK-norm;
RMSNorms before and after each block's attention and MLP, all scaling by 1 + their params; a
GELU-tanh gated MLP; embeddings multiplied by sqrt(width); queries scaled by
``query_pre_attn_scalar ** -0.5``; a 262k vocabulary and a tied head. The 1B, 4B and 27B depths
are not multiples of the six-layer pattern: the last layers run as the stack's tail
(``Decoder.Config.layer_pattern``).
"""

from __future__ import annotations

from titanax.modules.layers.rotary import LinearRopeScaling
from titanax.modules.models.decoder import Decoder

# The layer pattern of every published size: five local layers, then a global one.
GEMMA3_PATTERN = ("sliding",) * 5 + ("full",)


def gemma3_config(size: str, **overrides) -> Decoder.Config:
    """Published Gemma 3 sizes (their language models): "1b", "4b", "12b", "27b"."""
    shapes = {
        # vocab, layers, width, heads, kv heads, head_dim, hidden, query scalar, window,
        # longest sequence, global RoPE's linear factor
        "1b": (262144, 26, 1152, 4, 1, 256, 6912, 256, 512, 32768, None),
        "4b": (262208, 34, 2560, 8, 4, 256, 10240, 256, 1024, 131072, 8.0),
        "12b": (262208, 48, 3840, 16, 8, 256, 15360, 256, 1024, 131072, 8.0),
        "27b": (262208, 62, 5376, 32, 16, 128, 21504, 168, 1024, 131072, 8.0),
    }
    if size not in shapes:
        raise ValueError(f"unknown Gemma 3 size {size!r}; one of {', '.join(shapes)}")
    vocab, layers, width, heads, kv, head_dim, hidden, scalar, window, longest, factor = \
        shapes[size]
    scaling = None if factor is None else LinearRopeScaling.default_config().set(factor=factor)
    return Decoder.default_config().set(
        name="gemma3", vocab_size=vocab, max_seq_len=longest, num_layers=layers,
        model_dim=width, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, hidden_dim=hidden,
        mlp_activation="gelu_tanh", norm_eps=1e-6, qk_norm=True, norm_zero_centered=True,
        branch_output_norms=True, embedding_multiplier=width ** 0.5,
        attention_scale=None if scalar == head_dim else scalar ** -0.5,
        layer_pattern=GEMMA3_PATTERN, sliding_window=window, rope_theta=1000000.0,
        rope_scaling=scaling, sliding_rope_theta=10000.0, tie_embeddings=True).set(**overrides)
