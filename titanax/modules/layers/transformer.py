"""Pre-LN transformer block (GPT-2): ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

from __future__ import annotations

from typing import Optional

from titanax.config import REQUIRED, Required
from titanax.modules.axis_binding import RESIDUAL_SEQUENCE
from titanax.modules.base_layer import BaseLayer
from titanax.modules.initializers import Initializer
from titanax.modules.layers.attention import CausalSelfAttention
from titanax.modules.layers.dropout import Dropout
from titanax.modules.layers.mlp import MLP
from titanax.modules.layers.norm import LayerNorm


class TransformerBlock(BaseLayer):
    """One decoder layer."""

    class Config(BaseLayer.Config):
        # Residual-stream width.
        model_dim: Required[int] = REQUIRED
        # Attention heads.
        num_heads: Required[int] = REQUIRED
        # MLP hidden width.
        hidden_dim: Required[int] = REQUIRED
        # Dropout on each residual branch's output (training only).
        dropout_rate: float = 0.0
        # Dropout on attention probabilities (training only).
        attention_dropout_rate: float = 0.0
        # LayerNorm epsilon (GPT-2: 1e-5).
        norm_eps: float = 1e-5
        # Initializer of the two projections that write into the residual stream (attention
        # output, MLP down-projection); None: the block's param_init.
        output_param_init: Optional[Initializer.Config] = None

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        cfg = self.config
        self._add_child("ln1", LayerNorm.default_config().set(input_dim=cfg.model_dim,
                                                              eps=cfg.norm_eps))
        self._add_child("attn", CausalSelfAttention.default_config().set(
            model_dim=cfg.model_dim, num_heads=cfg.num_heads,
            attention_dropout_rate=cfg.attention_dropout_rate,
            output_param_init=cfg.output_param_init))
        self._add_child("ln2", LayerNorm.default_config().set(input_dim=cfg.model_dim,
                                                              eps=cfg.norm_eps))
        self._add_child("mlp", MLP.default_config().set(
            model_dim=cfg.model_dim, hidden_dim=cfg.hidden_dim,
            output_param_init=cfg.output_param_init))
        # Under sequence parallelism the residual stream is split over the sequence.
        self._add_child("dropout", Dropout.default_config().set(
            rate=cfg.dropout_rate, split_dims=(RESIDUAL_SEQUENCE,)))

    def forward(self, x, *, segment_ids=None, positions=None):
        """``segment_ids`` (``[batch, seq]``, packed rows): attention stays inside each
        document. (``positions`` are GPT's learned table's, added at the embedding; attention
        reads them only under context parallelism, for its causal mask.)"""
        x = x + self.dropout(self.attn(self.ln1(x), segment_ids=segment_ids,
                                       positions=positions))
        return x + self.dropout(self.mlp(self.ln2(x)))
