"""One layer of today's decoders (Llama, Qwen, Mistral): pre-RMSNorm attention and SwiGLU MLP
(or a mixture of SwiGLU experts: Mixtral, Qwen 3 MoE).

``x + attn(input_norm(x))``, then ``x + mlp(post_attention_norm(x))``: Hugging Face's
``input_layernorm`` / ``self_attn`` / ``post_attention_layernorm`` / ``mlp``. No dropout (none of
these models uses it).
"""

from __future__ import annotations

from typing import Union

from titanax.config import REQUIRED, Required
from titanax.modules.base_layer import BaseLayer
from titanax.modules.layers.gated_mlp import GatedMLP
from titanax.modules.layers.grouped_query_attention import GroupedQueryAttention
from titanax.modules.layers.moe import MoE
from titanax.modules.layers.norm import RMSNorm


class DecoderBlock(BaseLayer):
    """One decoder layer."""

    class Config(BaseLayer.Config):
        # Residual-stream width.
        model_dim: Required[int] = REQUIRED
        # The attention (its model_dim follows the block's).
        attention: GroupedQueryAttention.Config = GroupedQueryAttention.default_config()
        # The feed-forward block, dense or a mixture of experts (its model_dim follows the
        # block's).
        mlp: Union[GatedMLP.Config, MoE.Config] = GatedMLP.default_config()
        # RMSNorm epsilon.
        norm_eps: float = 1e-6

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        cfg = self.config
        self._add_child("input_norm", RMSNorm.default_config().set(input_dim=cfg.model_dim,
                                                                   eps=cfg.norm_eps))
        self._add_child("attn", cfg.attention.clone(model_dim=cfg.model_dim))
        self._add_child("post_attention_norm", RMSNorm.default_config().set(
            input_dim=cfg.model_dim, eps=cfg.norm_eps))
        self._add_child("mlp", cfg.mlp.clone(model_dim=cfg.model_dim))

    def forward(self, x, *, segment_ids=None, positions=None):
        """``segment_ids`` / ``positions`` (``[batch, seq]``): packed documents (attention stays
        inside each; RoPE restarts in each)."""
        x = x + self.attn(self.input_norm(x), positions=positions, segment_ids=segment_ids)
        # A mixture of experts routes no padding (segment 0) token.
        routing = {"segment_ids": segment_ids} if isinstance(self.mlp, MoE) else {}
        return x + self.mlp(self.post_attention_norm(x), **routing)

    def decode(self, x, cache, *, start):
        """``forward`` for tokens at ``start ..`` over the attention's key/value ``cache``;
        returns ``(x, cache)`` (see ``GroupedQueryAttention.decode``)."""
        attended, cache = self.attn.decode(self.input_norm(x), cache, start=start)
        x = x + attended
        return x + self.mlp(self.post_attention_norm(x)), cache
