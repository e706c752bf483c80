"""Causal multi-head self-attention with a fused QKV projection, split by heads under TP.

The QKV weight is stored ``[model_dim, 3, num_heads, head_dim]`` (q, k, v stacked, each head's
columns contiguous). Its heads are the logical ``heads`` dimension: where the axis binding splits
it (TP), every device holds whole heads of q, k and v -- no collective until the output
projection, a Linear whose input features (``heads``) are exactly this device's heads. Where the
binding splits the ``sequence`` (context parallelism), keys cross devices as
parallel/context_attention.py says. Softmax runs in float32. The attention itself is
``jax.nn.dot_product_attention`` (causal, implementation chosen by jax: cuDNN flash attention on
GPUs), except in training with attention dropout, which needs the probabilities written out.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from titanax import errors
from titanax.config import REQUIRED, Required
from titanax.modules.axis_binding import HEADS, RESIDUAL_SEQUENCE, SEQUENCE
from titanax.modules.base_layer import BaseLayer, ParameterSpec, constant
from titanax.modules.initializers import FanAxes, Initializer
from titanax.modules.layers.dropout import Dropout
from titanax.modules.layers.grouped_query_attention import same_segment
from titanax.modules.layers.linear import Linear
from titanax.modules.module import nowrap
from titanax.parallel import collectives
from titanax.parallel.context_attention import context_attention
from titanax.utils.dtypes import fused_attention_fits, lowest, wide_float


class CausalSelfAttention(BaseLayer):
    """GPT-style attention: each position attends to itself and earlier positions."""

    class Config(BaseLayer.Config):
        # Width of the input and output.
        model_dim: Required[int] = REQUIRED
        # Attention heads; must divide model_dim (and be divisible by the TP size).
        num_heads: Required[int] = REQUIRED
        # Dropout on the attention probabilities (training only).
        attention_dropout_rate: float = 0.0
        # Initializer of the output projection's weight; None: the layer's param_init.
        output_param_init: Optional[Initializer.Config] = None

        def _validate_values(self):
            if isinstance(self.model_dim, int) and isinstance(self.num_heads, int) \
                    and self.num_heads > 0 and self.model_dim % self.num_heads:
                yield "num_heads", f"must divide model_dim={self.model_dim}"

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        cfg = self.config
        # The output projection: row-parallel under TP (its input features are this device's heads).
        self._add_child("out", Linear.default_config().set(
            input_dim=cfg.model_dim, output_dim=cfg.model_dim, input_dim_name=HEADS,
            param_init=cfg.output_param_init))
        self._add_child("dropout", Dropout.default_config().set(
            rate=cfg.attention_dropout_rate, split_dims=(HEADS,)))

    @property
    def head_dim(self) -> int:
        return self.config.model_dim // self.config.num_heads

    def _create_layer_parameter_specs(self):
        cfg = self.config
        shape = (cfg.model_dim, 3, cfg.num_heads, self.head_dim)
        return {
            "qkv_weight": ParameterSpec(shape=shape, logical_axes=(None, None, HEADS, None),
                                        fan_axes=FanAxes(in_axes=(0,), out_axes=(1, 2, 3))),
            "qkv_bias": ParameterSpec(shape=shape[1:], logical_axes=(None, HEADS, None),
                                      initializer=constant(0.0), weight_decay_scale=0.0),
        }

    def _own_implemented_dims(self):
        return (SEQUENCE,)

    @nowrap
    def check_axis_binding(self, binding, *, path):
        refuse_split_attention_dropout(self.config.attention_dropout_rate, binding, path=path)
        super().check_axis_binding(binding, path=path)

    def forward(self, x, segment_ids=None, positions=None):
        """``segment_ids`` ``[batch, seq]`` (packed rows): a position attends only to earlier
        positions of its own document. ``positions`` ``[batch, seq]``: only read under context
        parallelism (the causal mask follows them)."""
        cfg = self.config
        params = self.parameters
        binding = self.axis_binding
        if binding.active(RESIDUAL_SEQUENCE) is not None:
            x = collectives.all_gather(x, binding.active(RESIDUAL_SEQUENCE), axis_index=1)
        qkv = jnp.einsum("bsd,dthk->bsthk", x, params["qkv_weight"].astype(x.dtype))
        qkv = qkv + params["qkv_bias"].astype(x.dtype)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [batch, seq, local heads, head_dim]
        dropout = self.is_training and cfg.attention_dropout_rate > 0
        documents = same_segment(segment_ids)
        if binding.axis(SEQUENCE) is not None:  # (check_axis_binding refuses dropout here.)
            context = context_attention(q, k, v, positions=positions, segment_ids=segment_ids,
                                        axis=binding.axis(SEQUENCE),
                                        strategy=binding.context_strategy,
                                        scale=1.0 / math.sqrt(self.head_dim))
        elif dropout or not fused_attention_fits(q.dtype):
            context = self._attention_written_out(q, k, v, documents)
        else:
            # jax's fused attention: cuDNN flash attention on GPUs (no S x S mask or
            # probabilities in memory), XLA's softmax(QK^T)V elsewhere; logits in float32.
            context = jax.nn.dot_product_attention(q, k, v, mask=documents, is_causal=True,
                                                   scale=1.0 / math.sqrt(self.head_dim),
                                                   implementation=None)
        context = context.reshape(context.shape[:2] + (-1,))
        return self.out(context)

    def _attention_written_out(self, q, k, v, documents=None):
        """The same attention written out: attention dropout needs the probabilities, XLA:CPU
        cannot compile jax's fused float16 attention, and its float64 rounds through float32
        (``fused_attention_fits``; dropout is the identity outside training)."""
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k,
                            preferred_element_type=wide_float(q.dtype)) / math.sqrt(self.head_dim)
        length = q.shape[1]
        causal = jnp.tril(jnp.ones((length, length), dtype=bool))
        allowed = causal if documents is None else causal & documents
        scores = jnp.where(allowed, scores, lowest(scores.dtype))
        probs = self.dropout(jax.nn.softmax(scores, axis=-1)).astype(v.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def refuse_split_attention_dropout(rate: float, binding, *, path: str) -> None:
    """Attention dropout under context parallelism, refused before anything compiles (``path``:
    the config holding ``attention_dropout_rate``)."""
    if binding.axis(SEQUENCE) is not None and rate:
        raise errors.PlanError(
            "attention dropout needs each query's whole row of probabilities, which context "
            "parallelism never holds in one place", path=f"{path}.attention_dropout_rate",
            suggestion="set it to 0 under context parallelism (residual dropout is fine)")
