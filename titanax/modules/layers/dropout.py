"""Dropout, with masks that agree or differ across devices as the data requires.

The engine gives each data shard its own key and every TP rank of a shard the same key, so by
default a mask is identical across the TP axis -- right for activations replicated there (the
residual stream). For activations *split* along a logical dimension (attention heads, or the
residual stream's sequence under sequence parallelism) name it in ``split_dims``: where the axis
binding splits it, the key folds in this device's rank along it, so each shard gets its own mask,
exactly as if one device had drawn the mask for the whole tensor at random.
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp

from titanax.modules.base_layer import BaseLayer


class Dropout(BaseLayer):
    """Zeroes each element with probability ``rate`` in training, rescaling the rest."""

    class Config(BaseLayer.Config):
        # Probability of dropping an element.
        rate: float = 0.0
        # Logical dimensions the activations are split along (e.g. ("heads",)): where the
        # binding splits one, masks differ per rank along its axis.
        split_dims: Tuple[str, ...] = ()

        def _validate_values(self):
            if not 0.0 <= self.rate < 1.0:
                yield "rate", f"must be in [0, 1), got {self.rate}"

    def forward(self, x):
        cfg = self.config
        if not self.is_training or cfg.rate == 0.0:
            return x
        key = self.prng_key
        binding = self.axis_binding
        for dim in cfg.split_dims:
            if binding.active(dim) is not None:
                key = jax.random.fold_in(key, binding.rank(dim))
        keep = jax.random.bernoulli(key, 1.0 - cfg.rate, x.shape)
        return jnp.where(keep, x / (1.0 - cfg.rate), jnp.zeros_like(x))
