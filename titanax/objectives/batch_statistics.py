"""Statistics of the whole batch inside an objective's loss, the same on every device and mesh:
summed over this device's rows, then over the batch axes (``Objective.loss``'s ``batch_axes``)."""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp

from titanax.parallel import collectives


def batch_mean(values: jax.Array, counts: jax.Array, batch_axes: Tuple[str, ...]) -> jax.Array:
    """``sum(values) / sum(counts)`` over the whole batch (0 where nothing counts)."""
    total, count = jnp.sum(values), jnp.sum(counts)
    if batch_axes:
        total, count = (collectives.psum(x, batch_axes) for x in (total, count))
    return total / jnp.maximum(count, 1.0)
