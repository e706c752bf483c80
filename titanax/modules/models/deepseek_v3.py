"""DeepSeek-V3's configuration of the decoder family, at its published size.

Multi-head latent attention in every layer (queries through a 1,536-wide low-rank projection,
keys and values from one 512-wide latent per token plus a 64-wide RoPE key shared by the heads;
YaRN over a 4,096-token original context); the first layers dense, then 256 routed experts of
2,048 (8 per token, chosen by sigmoid scores plus a balancing bias among the best 4 of 8 groups,
gates renormalised and scaled by 2.5) beside one shared expert; one multi-token-prediction
depth; a 129k vocabulary, untied head.
"""

from __future__ import annotations

from titanax.modules.layers.latent_attention import MultiHeadLatentAttention
from titanax.modules.layers.moe import MoE
from titanax.modules.layers.rotary import YarnRopeScaling
from titanax.modules.models.decoder import Decoder


def deepseek_v3_config(size: str, **overrides) -> Decoder.Config:
    """Published sizes: "671b" (DeepSeek-V3 / V3.1 / R1: 61 layers, 37B active per token).
    Trained from scratch, the balancing bias moves by 0.001 per step (the paper's gamma; a
    checkpoint's bias is kept as loaded instead: HF import)."""
    if size != "671b":
        raise ValueError(f"unknown DeepSeek-V3 size {size!r}; one of 671b")
    moe = MoE.default_config().set(hidden_dim=2048, num_experts=256, top_k=8,
                                   shared_hidden_dim=2048, dispatch="dropless")
    moe.router.set(scoring="sigmoid", normalize_top_k=True, balance_rate=0.001,
                   routed_scaling=2.5, num_groups=8, top_groups=4)
    latent = MultiHeadLatentAttention.default_config().set(
        num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128)
    yarn = YarnRopeScaling.default_config().set(
        factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
        mscale=1.0, mscale_all_dim=1.0)
    return Decoder.default_config().set(
        name="deepseek_v3", vocab_size=129280, max_seq_len=163840, num_layers=61,
        model_dim=7168, num_heads=128, hidden_dim=18432, norm_eps=1e-6,
        latent_attention=latent, moe=moe, first_dense_layers=3, mtp_depths=1,
        rope_theta=10000.0, rope_scaling=yarn, tie_embeddings=False).set(**overrides)
