"""Attention over a sequence split across a context-parallel axis (``context_parallel.py``).

Each rank holds its queries, keys and values ``[batch, t, heads, head_dim]`` for its share of
every row, with the tokens' ``positions`` and ``segment_ids``. A query may see a key when the
key's position is not after its own and both are in one document (and within the sliding
window): the mask is built from positions, not array places, so any token order works (the
load-balanced one included).

- ``all_gather``: keys, values, and their positions and segments are gathered over the axis
  (one all-gather of K and V stacked, per layer; its transpose reduce-scatters their gradients),
  then each rank attends its queries over the whole row -- blockwise from BLOCKWISE_FROM keys on
  (``modules/layers/blockwise_attention.py``: tiles chosen by the tokens' positions). Memory: the
  whole row's K/V per rank.
- ``ring``: the K/V blocks travel around a ``ppermute`` ring, C steps, each rank folding the
  block it holds into its queries' online softmax (running max and sum, as flash attention does)
  tile by tile (``modules/layers/blockwise_attention.fold_keys``: no score tensor larger than one
  ``RING_TILE`` x ``RING_TILE`` tile, and a tile none of whose keys its queries may see is never
  visited -- under the dual-chunk order that skips the masked half of each visiting block). The
  backward pass is a ring too (a custom VJP): each block travels with its gradient accumulators
  and is home after C steps. Only the local queries, one visiting block and the outputs'
  log-sum-exp are kept: memory is flat in C and linear in the local sequence.
- ``ulysses``: an all-to-all turns sequence shards into head shards (each rank: the whole row,
  heads / C of them), attention runs as on one device, and another all-to-all turns the output
  back. Needs the local heads divisible by C (kv heads that C does not divide are repeated to
  one per query head first).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from titanax import errors
from titanax.parallel import collectives
from titanax.modules.layers.blockwise_attention import (
    BLOCKWISE_FROM, Static, blockwise_attention, cast_like, empty_state, finish, fold_key_grads,
    fold_keys, padded_keys, padded_queries, query_grad_blocks, unblocked)
from titanax.modules.layers.softmax_attention import masked_attention
from titanax.utils.dtypes import wide_float


# Why the ring takes no sinks, and what to use instead (``Attention.check_axis_binding`` says it
# before anything compiles).
SINKS_ON_A_RING = ("attention sinks under the ring strategy are not built (its custom backward "
                   "pass carries no log-sum-exp gradient, which a sink's term needs)")
SINKS_ON_A_RING_SUGGESTION = ("use --config.plan.context_parallel.strategy=all_gather or "
                              "ulysses for a model with attention sinks")


def context_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, positions: jax.Array,
                      segment_ids: Optional[jax.Array], axis: str, strategy: str, scale: float,
                      sliding_window: Optional[int] = None,
                      sinks: Optional[jax.Array] = None) -> jax.Array:
    """``[batch, t, heads, head_dim]`` attention outputs of this rank's queries (see the module
    docstring). ``k``/``v`` may have fewer heads than ``q`` (grouped-query attention).
    ``sinks`` ``[heads]``: gpt-oss's per-head sink logits (all_gather and ulysses: each query's
    softmax is over the whole row there, so the sink joins it once)."""
    if positions is None or jnp.ndim(positions) != 2:
        raise errors.PlanError("context-parallel attention needs each token's [batch, seq] "
                               "positions", path="plan.context_parallel",
                               suggestion="feed batches through the engine, which adds them")
    if strategy == "all_gather":
        return _all_gather(q, k, v, positions=positions, segment_ids=segment_ids, axis=axis,
                           scale=scale, sliding_window=sliding_window, sinks=sinks)
    if strategy == "ring":
        if sinks is not None:
            raise errors.PlanError(SINKS_ON_A_RING, path="plan.context_parallel.strategy",
                                   suggestion=SINKS_ON_A_RING_SUGGESTION)
        segments = (jnp.zeros_like(positions) if segment_ids is None
                    else segment_ids.astype(positions.dtype))
        return _ring(q, k, v, positions, segments, axis, float(scale), sliding_window)
    if strategy == "ulysses":
        return _ulysses(q, k, v, positions=positions, segment_ids=segment_ids, axis=axis,
                        scale=scale, sliding_window=sliding_window, sinks=sinks)
    raise errors.PlanError(f"unknown context-parallel strategy {strategy!r}",
                           path="plan.context_parallel.strategy",
                           suggestion="use 'all_gather', 'ring' or 'ulysses'")


def _all_gather(q, k, v, *, positions, segment_ids, axis, scale, sliding_window, sinks):
    kv = collectives.all_gather(jnp.stack([k, v]), axis, axis_index=2)
    return attend_gathered_row(q, kv[0], kv[1], positions=positions, segment_ids=segment_ids,
                               axis=axis, scale=scale, sliding_window=sliding_window,
                               sinks=sinks)


def attend_gathered_row(q: jax.Array, k: jax.Array, v: jax.Array, *, positions: jax.Array,
                        segment_ids: Optional[jax.Array], axis: str, scale: float,
                        sliding_window: Optional[int] = None,
                        sinks: Optional[jax.Array] = None) -> jax.Array:
    """This rank's queries over keys and values of the whole row, gathered over ``axis`` in
    rank order (``all_gather``'s; a layer that gathers something smaller and expands it --
    latent attention's latent -- calls this with its expansion): the tokens' positions and
    segments are gathered alike, and the mask built from them."""
    key_positions = collectives.all_gather(positions, axis, axis_index=1)
    key_segments = (None if segment_ids is None
                    else collectives.all_gather(segment_ids, axis, axis_index=1))
    return _attend_rows(q, k, v, scale=scale, queries=(positions, segment_ids),
                        keys=(key_positions, key_segments), sliding_window=sliding_window,
                        sinks=sinks)


def _ulysses(q, k, v, *, positions, segment_ids, axis, scale, sliding_window, sinks):
    size = collectives.axis_size(axis)
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % size:
        raise errors.PlanError(
            f"Ulysses splits the {heads} attention heads of each rank over the {size} devices of "
            f"{axis!r}: they do not divide", path="plan.context_parallel.strategy",
            suggestion="use a context size that divides the heads (after TP), or strategy "
                       "'ring' / 'all_gather'")
    if kv_heads % size:  # Each query head's kv head must travel with it.
        k, v = (jnp.repeat(x, heads // kv_heads, axis=2) for x in (k, v))
    to_heads = lambda x: collectives.all_to_all(x, axis, split_dimension=2,  # noqa: E731
                                                concat_dimension=1)
    row_positions = collectives.all_gather(positions, axis, axis_index=1)
    row_segments = (None if segment_ids is None
                    else collectives.all_gather(segment_ids, axis, axis_index=1))
    if sinks is not None:  # (Rank r attends the r-th block of this rank's heads.)
        local = heads // size
        sinks = jax.lax.dynamic_slice_in_dim(sinks, collectives.axis_index(axis) * local, local)
    out = _attend_rows(to_heads(q), to_heads(k), to_heads(v), scale=scale,
                       queries=(row_positions, row_segments), keys=(row_positions, row_segments),
                       sliding_window=sliding_window, sinks=sinks)
    return collectives.all_to_all(out, axis, split_dimension=1, concat_dimension=2)


def _attend_rows(q, k, v, *, scale, queries, keys, sliding_window, sinks=None):
    """Attention of ``q`` over ``k``/``v`` by the tokens' ``(positions, segments)``: blockwise
    (O(S) memory, masked tiles skipped) from BLOCKWISE_FROM keys on, written out below."""
    (q_pos, q_seg), (k_pos, k_seg) = queries, keys
    if k.shape[1] >= BLOCKWISE_FROM:
        return blockwise_attention(q, k, v, scale=scale, q_positions=q_pos, k_positions=k_pos,
                                   q_segments=q_seg, k_segments=k_seg,
                                   sliding_window=sliding_window, block_q=RING_TILE,
                                   block_k=RING_TILE, sinks=sinks)
    allowed = visible(q_pos, k_pos, q_seg, k_seg, sliding_window=sliding_window)
    return masked_attention(q, k, v, allowed, scale=scale, sinks=sinks)


# --- Ring attention: an online softmax over the blocks that pass by, a custom VJP ------------------

# Query / key tile length inside each ring step (a visiting block is folded in tiles of this).
RING_TILE = 512


def _ring_static(scale, window, queries: int, keys: int) -> Static:
    return Static(scale, window, min(RING_TILE, queries), min(RING_TILE, keys))


def _ring_forward(q, k, v, positions, segments, axis, scale, window):
    """``(out, lse)``: attention of the local queries over every rank's block, and the
    log-sum-exp of each query's scores ``[b, g, r, t]``. Each visiting block is folded into
    the queries' online softmax tile by tile (blockwise_attention.fold_keys): no score tensor
    larger than a tile, and tiles no query sees are skipped."""
    size = collectives.axis_size(axis)
    t = q.shape[1]
    static = _ring_static(scale, window, t, k.shape[1])
    q_p, q_pos, q_seg = padded_queries(q, positions, segments, static.block_q)
    block = padded_keys(k, v, positions, segments, static.block_k)
    state = empty_state(q_p, k.shape[2], static.block_q, like=(k, v, positions, segments))
    for step in range(size):
        state = fold_keys(state, q_p, q_pos, q_seg, *block, static)
        if step + 1 < size:
            block = collectives.shift(block, axis)
    out, lse = finish(state, q.dtype)
    return out[:, :t], lse[..., :t]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _ring(q, k, v, positions, segments, axis, scale, window):
    return _ring_forward(q, k, v, positions, segments, axis, scale, window)[0]


def _ring_fwd(q, k, v, positions, segments, axis, scale, window):
    out, lse = _ring_forward(q, k, v, positions, segments, axis, scale, window)
    return out, (q, k, v, positions, segments, out, lse)


def _ring_bwd(axis, scale, window, residuals, d_out):
    """The ring again: each block travels with its gradient accumulators, each rank adding its
    queries' share tile by tile (blockwise_attention.fold_key_grads); after C moves the
    gradients are home."""
    q, k, v, positions, segments, out, lse = residuals
    size = collectives.axis_size(axis)
    t, s = q.shape[1], k.shape[1]
    static = _ring_static(scale, window, t, s)
    q_p, q_pos, q_seg = padded_queries(q, positions, segments, static.block_q)
    pad = q_p.shape[1] - t
    rows = ((0, 0), (0, pad), (0, 0), (0, 0))
    q_blocks = query_grad_blocks(
        q_p, q_pos, q_seg, jnp.pad(d_out, rows), jnp.pad(out, rows),
        jnp.pad(lse, ((0, 0), (0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf),
        static.block_q)
    keys = padded_keys(k, v, positions, segments, static.block_k)
    typed = cast_like(q, k, v, positions, segments, d_out, lse)
    wide = wide_float(q.dtype)
    d_q = typed(jnp.zeros(q_blocks[0].shape, wide))
    zeros = typed(jnp.zeros(keys[0].shape, wide))
    block = keys + (zeros, zeros)
    for step in range(size):
        d_q, d_k, d_v = fold_key_grads(d_q, q_blocks, *block[:4], static)
        block = block[:4] + (block[4] + d_k, block[5] + d_v)
        # The block and its gradients move on; after the C-th move the gradients are home.
        block = (collectives.shift(block, axis) if step + 1 < size
                 else block[:4] + collectives.shift(block[4:], axis))
    d_q = unblocked(d_q)[:, :t]
    return (d_q.astype(q.dtype), block[4][:, :s].astype(k.dtype),
            block[5][:, :s].astype(v.dtype), None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def visible(query_positions: jax.Array, key_positions: jax.Array,
            query_segments: Optional[jax.Array], key_segments: Optional[jax.Array], *,
            sliding_window: Optional[int] = None) -> jax.Array:
    """``[batch, 1, t, s]``: which key each query may see (causal by position, same document,
    within the window)."""
    q_pos, k_pos = query_positions[:, :, None], key_positions[:, None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    if query_segments is not None:
        allowed &= query_segments[:, :, None] == key_segments[:, None, :]
    return allowed[:, None]
