"""One layer of the decoder family: pre-norm attention, then a pre-norm feed-forward block.

``x + attn(input_norm(x))``, then ``x + mlp(post_attention_norm(x))`` -- Hugging Face's
``input_layernorm`` / ``self_attn`` (or ``linear_attn``) / ``post_attention_layernorm`` /
``mlp`` (GPT-2's ``ln_1`` / ``attn`` / ``ln_2`` / ``mlp``). With ``output_norms`` each branch's
output is normed too before it joins the residual stream -- ``x + attention_output_norm(attn(..))``,
``x + mlp_output_norm(mlp(..))`` (Gemma 2/3's "sandwich": HF ``post_attention_layernorm`` and
``post_feedforward_layernorm``; its ``pre_feedforward_layernorm`` is ``post_attention_norm``
here, the norm before the MLP). The norms are RMSNorm (Llama, Qwen, Mistral) or LayerNorm with a
bias (GPT-2); the feed-forward block a (gated) MLP or a mixture of experts (Mixtral, Qwen 3 MoE);
each residual branch may end in dropout (GPT-2's resid_pdrop; training only).
"""

from __future__ import annotations

from typing import Literal, Union

import jax.numpy as jnp

from titanax.config import REQUIRED, Required
from titanax.parallel.axis_binding import RESIDUAL_SEQUENCE
from titanax.modules.base_layer import BaseLayer
from titanax.modules.layers.attention import Attention
from titanax.modules.layers.dropout import Dropout
from titanax.modules.layers.gated_deltanet import GatedDeltaNet
from titanax.modules.layers.latent_attention import MultiHeadLatentAttention
from titanax.modules.layers.mlp import MLP
from titanax.modules.layers.moe import MoE
from titanax.modules.layers.norm import LayerNorm, RMSNorm

NORMS = {"rms": RMSNorm, "layer": LayerNorm}


class DecoderBlock(BaseLayer):
    """One decoder layer."""

    class Config(BaseLayer.Config):
        # Residual-stream width.
        model_dim: Required[int] = REQUIRED
        # The token mixer (its model_dim follows the block's): softmax attention, DeepSeek's
        # multi-head latent attention, or Gated DeltaNet's linear attention (Qwen 3.5's
        # "linear_attention" layers).
        attention: Union[Attention.Config, MultiHeadLatentAttention.Config,
                         GatedDeltaNet.Config] = Attention.default_config()
        # The feed-forward block, dense or a mixture of experts (its model_dim follows the
        # block's).
        mlp: Union[MLP.Config, MoE.Config] = MLP.default_config()
        # "rms": RMSNorm (Llama, Qwen, Mistral); "layer": LayerNorm with a bias (GPT-2).
        norm: Literal["rms", "layer"] = "rms"
        # The norms' epsilon.
        norm_eps: float = 1e-6
        # RMSNorm scales of 1 + their params (RMSNorm.Config.zero_centered: Qwen 3.5, Gemma).
        norm_zero_centered: bool = False
        # Dropout on each residual branch's output (training only).
        dropout_rate: float = 0.0
        # A norm of each branch's output before the residual add (Gemma 2/3).
        output_norms: bool = False

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        cfg = self.config
        norm = NORMS[cfg.norm].default_config().set(input_dim=cfg.model_dim, eps=cfg.norm_eps)
        if cfg.norm_zero_centered:
            norm.zero_centered = True
        self._add_child("input_norm", norm)
        self._add_child("attn", cfg.attention.clone(model_dim=cfg.model_dim))
        self._add_child("post_attention_norm", norm.clone())
        self._add_child("mlp", cfg.mlp.clone(model_dim=cfg.model_dim))
        if cfg.output_norms:
            self._add_child("attention_output_norm", norm.clone())
            self._add_child("mlp_output_norm", norm.clone())
        # Under sequence parallelism the residual stream is split over the sequence.
        self._add_child("dropout", Dropout.default_config().set(
            rate=cfg.dropout_rate, split_dims=(RESIDUAL_SEQUENCE,)))

    def forward(self, x, *, segment_ids=None, positions=None, routed=None):
        """``segment_ids`` / ``positions`` (``[batch, seq]``): packed documents (attention stays
        inside each; RoPE restarts in each). ``routed`` (``[batch, seq]`` bool): the tokens a
        mixture of experts routes, where fewer than every non-padding one (a multi-token-
        prediction depth's: those with a target)."""
        attended = self.attn(self.input_norm(x), positions=positions, segment_ids=segment_ids)
        x = x + self.dropout(self._branch_output("attention_output_norm", attended))
        # A mixture of experts routes no padding (segment 0) token.
        if routed is not None:
            segment_ids = jnp.where(routed, 1 if segment_ids is None else segment_ids, 0)
        routing = {"segment_ids": segment_ids} if isinstance(self.mlp, MoE) else {}
        mixed = self.mlp(self.post_attention_norm(x), **routing)
        return x + self.dropout(self._branch_output("mlp_output_norm", mixed))

    def _branch_output(self, norm: str, y):
        """A residual branch's output, normed by child ``norm`` with ``output_norms``."""
        return getattr(self, norm)(y) if self.config.output_norms else y

    def decode(self, x, cache, *, start, offsets=None):
        """``forward`` for tokens at ``start ..`` over the attention's key/value ``cache``;
        returns ``(x, cache)`` (see ``Attention.decode``; ``offsets``: left padding)."""
        attended, cache = self.attn.decode(self.input_norm(x), cache, start=start,
                                           offsets=offsets)
        x = x + self._branch_output("attention_output_norm", attended)
        mixed = self.mlp(self.post_attention_norm(x))
        return x + self._branch_output("mlp_output_norm", mixed), cache
