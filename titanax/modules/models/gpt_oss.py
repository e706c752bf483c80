"""gpt-oss's configuration of the decoder family, at its published sizes.

Sliding-window (128) and full attention layers in turn, each head with a learned sink logit,
biased q/k/v/o projections, YaRN (factor 32 over a 4,096-token original context); every MLP a
mixture of experts with biases, a biased router (top 4, softmax over the chosen) and the clamped
SwiGLU; a 201k vocabulary, untied head.
"""

from __future__ import annotations

from titanax.modules.layers.moe import MoE
from titanax.modules.layers.rotary import YarnRopeScaling
from titanax.modules.models.decoder import Decoder


def gpt_oss_config(size: str, **overrides) -> Decoder.Config:
    """Published gpt-oss sizes: "20b" (32 experts), "120b" (128 experts)."""
    shapes = {"20b": (24, 32), "120b": (36, 128)}  # layers, experts
    if size not in shapes:
        raise ValueError(f"unknown gpt-oss size {size!r}; one of {', '.join(shapes)}")
    layers, experts = shapes[size]
    moe = MoE.default_config().set(hidden_dim=2880, num_experts=experts, top_k=4,
                                   activation="clamped_swiglu", expert_bias=True,
                                   swiglu_alpha=1.702, swiglu_limit=7.0)
    moe.router.normalize_top_k = True
    moe.router.bias = True
    yarn = YarnRopeScaling.default_config().set(
        factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
        truncate=False)
    return Decoder.default_config().set(
        name="gpt_oss", vocab_size=201088, max_seq_len=131072, num_layers=layers,
        model_dim=2880, num_heads=64, num_kv_heads=8, head_dim=64, hidden_dim=2880,
        norm_eps=1e-5, qkv_bias=True, attention_output_bias=True, attention_sinks=True,
        layer_pattern=("sliding", "full"), sliding_window=128, rope_theta=150000.0,
        rope_scaling=yarn, moe=moe, tie_embeddings=False).set(**overrides)
