"""Dropout, with masks that agree or differ across tensor-parallel ranks as the data requires.

The engine gives each data shard its own key and every TP rank of a shard the same key, so by
default a mask is identical across the TP axis -- right for activations replicated there (the
residual stream). For activations *split* over the TP axis (attention heads, or the sequence under
sequence parallelism) set ``split_over_tp``: the key then folds in the TP rank, so each shard gets
its own mask, exactly as if one device had drawn the mask for the whole tensor at random.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from titanax.modules.base_layer import BaseLayer
from titanax.modules.layers.tensor_parallel import tp_active, tp_rank


class Dropout(BaseLayer):
    """Zeroes each element with probability ``rate`` in training, rescaling the rest."""

    class Config(BaseLayer.Config):
        # Probability of dropping an element.
        rate: float = 0.0
        # Tensor-parallel axis of the surrounding layer (None: no TP).
        tp_axis: Optional[str] = None
        # The activations are split over the TP axis: masks differ per rank.
        split_over_tp: bool = False

        def _validate_values(self):
            if not 0.0 <= self.rate < 1.0:
                yield "rate", f"must be in [0, 1), got {self.rate}"

    def forward(self, x):
        cfg = self.config
        if not self.is_training or cfg.rate == 0.0:
            return x
        key = self.prng_key
        if cfg.split_over_tp and tp_active(cfg.tp_axis):
            key = jax.random.fold_in(key, tp_rank(cfg.tp_axis))
        keep = jax.random.bernoulli(key, 1.0 - cfg.rate, x.shape)
        return jnp.where(keep, x / (1.0 - cfg.rate), jnp.zeros_like(x))
