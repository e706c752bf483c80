"""ZeRO-1: the optimizer state split over the data axis, in local view.

Each param's local (TP-local) gradient is flattened, padded to a multiple of the data-axis size and
reduce-scattered, so device ``d`` ends up with the mean gradient of chunk ``d``. The optimizer
updates only that chunk (its state is chunk-sized: 1/N of the replicated state), and the updated
chunks are all-gathered back into the full local param. Communication per step: one reduce-scatter
plus one all-gather, the same bytes as the all-reduce it replaces.
"""

from __future__ import annotations

import math
from typing import Tuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from titanax.parallel import collectives, rules


def chunk_size(local_shape: Tuple[int, ...], data_size: int) -> int:
    return -(-math.prod(local_shape) // data_size)


def _padded_flat(x: jax.Array, data_size: int) -> jax.Array:
    flat = x.reshape(-1)
    pad = chunk_size(x.shape, data_size) * data_size - flat.shape[0]
    return jnp.pad(flat, (0, pad)) if pad else flat


def scatter_mean(grad: jax.Array, data_axis: str) -> jax.Array:
    """This device's chunk of the data-axis mean of ``grad``."""
    size = collectives.axis_size(data_axis)
    return collectives.reduce_scatter(_padded_flat(grad, size), data_axis, "mean")


def local_chunk(x: jax.Array, data_axis: str) -> jax.Array:
    """This device's chunk of a value that is identical across the data axis."""
    size = collectives.axis_size(data_axis)
    chunk = chunk_size(x.shape, size)
    return jax.lax.dynamic_slice_in_dim(_padded_flat(x, size),
                                        collectives.axis_index(data_axis) * chunk, chunk)


def gather(chunk: jax.Array, data_axis: str, local_shape: Tuple[int, ...]) -> jax.Array:
    """The full local value from every device's chunk."""
    flat = collectives.all_gather(chunk, data_axis, axis_index=0, invariant=True)
    return flat[:math.prod(local_shape)].reshape(local_shape)


def chunk_spec(param_spec: PartitionSpec, data_axis: str) -> PartitionSpec:
    """Spec of a chunk-shaped optimizer-state leaf, seen as one global 1-D array."""
    return PartitionSpec(tuple(rules.spec_axes(param_spec)) + (data_axis,))
