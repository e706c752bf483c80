"""The device side of a paged key/value cache: tokens written into their sequences' blocks, and
attention of each sequence's newest tokens over its own blocks.

A layer's pool is ``[num_blocks, block_size, kv heads, head_dim]`` (keys, and values alike; a
latent attention's latents and shared RoPE keys as one head, ``[.., 1, width]``); a
sequence's block table (``BlockPool.table``, padded to one width) names its blocks in the order
of its positions, so position ``p`` lives at ``(table[p // block_size], p % block_size)``. Each
row carries its own length: rows at different places of their generation decode together (the
point of continuous batching), and two rows whose tables share a block read the same keys
(a prompt's samples).

Attention here is written out over the gathered blocks -- one query per row when decoding, a
prompt's length when prefilling -- with ``masked_attention``'s numerics (scores in float32 or
wider, sinks as an extra softmax column), so a paged row computes what the contiguous cache's
row does.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from titanax.modules.layers.softmax_attention import masked_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Paging:
    """Where a decoding call's tokens go: each row's block table ``tables`` ``[b, blocks]`` and
    its tokens' positions ``positions`` ``[b, t]`` (-1: no token -- a shorter prompt's padding,
    or a slot with no sequence). Passed as a layer's ``decode(..., start=paging)``: the layers
    between the model and its attentions hand it on as they hand on a contiguous cache's
    ``start``."""

    tables: jax.Array
    positions: jax.Array
    # Each row's decode slot on its shard ``[b]`` (-1: none), where a recurrent layer keeps its
    # state (``slot_states.py``). None: the model has no such layer.
    slots: Optional[jax.Array] = None
    # Inside a stack's loop over its layers: the layer's index into pools stacked over the
    # layers, which the loop carries whole (each layer writes and reads its own slice in
    # place: a loop over them as scanned inputs and outputs copies the whole pool every step).
    # None: the pool is one layer's.
    layer: Optional[jax.Array] = None

    def at_layer(self, layer: jax.Array) -> "Paging":
        return dataclasses.replace(self, layer=layer)


def write(pool: jax.Array, values: jax.Array, *, tables: jax.Array, positions: jax.Array,
          layer: Optional[jax.Array] = None) -> jax.Array:
    """``pool`` with ``values`` ``[b, t, kv heads, head_dim]`` written at each row's
    ``positions`` ``[b, t]`` through its block table ``tables`` ``[b, blocks]`` (into layer
    ``layer``'s slice of a stacked pool, when given). A position of -1 writes nothing (a row
    with fewer tokens than ``t``, or a slot with no sequence)."""
    block_size, num_blocks = pool.shape[-3], pool.shape[-4]
    valid = positions >= 0
    places = jnp.where(valid, positions, 0)
    blocks = jnp.take_along_axis(tables, places // block_size, axis=1)
    # Writes that must not land go past the pool's end, where ``mode="drop"`` discards them.
    blocks = jnp.where(valid, blocks, num_blocks)
    values = values.astype(pool.dtype)
    if layer is None:
        return pool.at[blocks, places % block_size].set(values, mode="drop")
    return pool.at[layer, blocks, places % block_size].set(values, mode="drop")


def copy_blocks(pools, sources: jax.Array, targets: jax.Array):
    """``pools`` (any tree of pools: a stack's ``[layers, blocks, ...]``, an unstacked layer's
    ``[blocks, ...]``) with block ``sources[i]`` copied to ``targets[i]``: a prompt's last,
    partly filled block for each of its other samples (``slot_states.copy_prompts`` copies a
    model's whole paged cache)."""
    def copy(pool):
        axis = pool.ndim - 4  # [.., num_blocks, block_size, kv heads, head_dim]
        index = (slice(None),) * axis
        return pool.at[index + (targets,)].set(pool[index + (sources,)])
    return jax.tree_util.tree_map(copy, pools)


def gathered(pool: jax.Array, tables: jax.Array,
             layer: Optional[jax.Array] = None) -> jax.Array:
    """Each row's keys (or values) in the order of its positions: ``[b, blocks * block_size,
    kv heads, head_dim]`` (past a row's length: whatever its padding blocks hold); from layer
    ``layer``'s slice of a stacked pool, when given."""
    rows = pool[tables] if layer is None else pool[layer, tables]  # [b, blocks, bs, kv, d]
    return rows.reshape((tables.shape[0], -1) + pool.shape[-2:])


def attend(q: jax.Array, k: jax.Array, v: jax.Array, *, positions: jax.Array, scale: float,
           sliding_window: Optional[int] = None, sinks: Optional[jax.Array] = None) -> jax.Array:
    """Causal attention of ``q`` ``[b, t, heads, head_dim]`` -- row ``i``'s tokens at
    ``positions[i]`` ``[b, t]`` (-1: no token; its output is meaningless), their keys already
    written into the pool -- over each row's gathered keys and values ``k`` / ``v`` (``gathered``:
    ``[b, positions, heads, head_dim]``), up to its own position (within ``sliding_window`` of
    it when given). ``sinks`` ``[heads]``: per head, a logit that joins every softmax
    (gpt-oss)."""
    key_pos = jnp.arange(k.shape[1])[None, None, :]
    query_pos = positions[:, :, None]
    allowed = (key_pos <= query_pos) & (query_pos >= 0)
    if sliding_window is not None:
        allowed &= key_pos > query_pos - sliding_window
    return masked_attention(q, k.astype(q.dtype), v.astype(q.dtype), allowed[:, None],
                            scale=scale, sinks=sinks)
