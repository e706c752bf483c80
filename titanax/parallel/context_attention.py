"""Attention over a sequence split across a context-parallel axis (``context_parallel.py``).

Each rank holds its queries, keys and values ``[batch, t, heads, head_dim]`` for its share of
every row, with the tokens' ``positions`` and ``segment_ids``. A query may see a key when the
key's position is not after its own and both are in one document (and within the sliding
window): the mask is built from positions, not array places, so any token order works (the
load-balanced one included).

- ``all_gather``: keys, values, and their positions and segments are gathered over the axis
  (one all-gather of K and V stacked, per layer; its transpose reduce-scatters their gradients),
  then each rank attends its queries over the whole row. Memory: the whole row's K/V per rank.
- ``ring``: the K/V blocks travel around a ``ppermute`` ring, C steps, each rank folding the
  block it holds into its queries' output with an online softmax (running max and sum, as flash
  attention does); a block none of whose keys a query block may see is skipped. The backward
  pass is a ring too (a custom VJP): each block travels with its gradient accumulators and is
  home after C steps. Only the local block, one visiting block and the outputs' log-sum-exp are
  kept: memory stays flat in C. (With contiguous chunks, a sliding window or packed documents
  some blocks are skipped; under the default dual-chunk order every block holds keys some query
  sees, so the ring computes every block: about twice the causal minimum of work.)
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
from titanax.modules.layers.softmax_attention import masked_attention
from titanax.utils.dtypes import fused_attention_fits, wide_float


def context_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, positions: jax.Array,
                      segment_ids: Optional[jax.Array], axis: str, strategy: str, scale: float,
                      sliding_window: Optional[int] = None) -> jax.Array:
    """``[batch, t, heads, head_dim]`` attention outputs of this rank's queries (see the module
    docstring). ``k``/``v`` may have fewer heads than ``q`` (grouped-query attention)."""
    if positions is None or jnp.ndim(positions) != 2:
        raise errors.PlanError("context-parallel attention needs each token's [batch, seq] "
                               "positions", path="plan.context_parallel",
                               suggestion="feed batches through the engine, which adds them")
    if strategy == "all_gather":
        return _all_gather(q, k, v, positions=positions, segment_ids=segment_ids, axis=axis,
                           scale=scale, sliding_window=sliding_window)
    if strategy == "ring":
        segments = (jnp.zeros_like(positions) if segment_ids is None
                    else segment_ids.astype(positions.dtype))
        return _ring(q, k, v, positions, segments, axis, float(scale), sliding_window)
    if strategy == "ulysses":
        return _ulysses(q, k, v, positions=positions, segment_ids=segment_ids, axis=axis,
                        scale=scale, sliding_window=sliding_window)
    raise errors.PlanError(f"unknown context-parallel strategy {strategy!r}",
                           path="plan.context_parallel.strategy",
                           suggestion="use 'all_gather', 'ring' or 'ulysses'")


def _all_gather(q, k, v, *, positions, segment_ids, axis, scale, sliding_window):
    kv = collectives.all_gather(jnp.stack([k, v]), axis, axis_index=2)
    key_positions = collectives.all_gather(positions, axis, axis_index=1)
    key_segments = (None if segment_ids is None
                    else collectives.all_gather(segment_ids, axis, axis_index=1))
    allowed = visible(positions, key_positions, segment_ids, key_segments,
                      sliding_window=sliding_window)
    return _attend_rows(q, kv[0], kv[1], allowed, scale=scale)


def _ulysses(q, k, v, *, positions, segment_ids, axis, scale, sliding_window):
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
    allowed = visible(row_positions, row_positions, row_segments, row_segments,
                      sliding_window=sliding_window)
    out = _attend_rows(to_heads(q), to_heads(k), to_heads(v), allowed, scale=scale)
    return collectives.all_to_all(out, axis, split_dimension=1, concat_dimension=2)


def _attend_rows(q, k, v, allowed, *, scale):
    """Attention under ``allowed`` ``[b, 1, t, s]``: jax's fused call on a GPU, else written
    out."""
    if fused_attention_fits(q.dtype):
        return jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype),
                                            mask=allowed, is_causal=False, scale=scale,
                                            implementation=None)
    return masked_attention(q, k, v, allowed, scale=scale)


# --- Ring attention: an online softmax over the blocks that pass by, a custom VJP ------------------

def _block_scores(q, k, scale):
    """``[b, g, r, t, s]`` scores of queries ``[b, t, g*r, d]`` against keys ``[b, s, g, d]``
    (r query heads read each of the g kv heads), in float32 (or wider)."""
    b, t, n, d = q.shape
    g = k.shape[2]
    qg = q.reshape(b, t, g, n // g, d)
    return jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=wide_float(q.dtype)) * scale


def _block_mask(q_pos, q_seg, k_pos, k_seg, window):
    """``[b, 1, 1, t, s]``: which keys of a block each query may see."""
    return visible(q_pos, k_pos, q_seg, k_seg, sliding_window=window)[:, :, None]


def _ring_forward(q, k, v, positions, segments, axis, scale, window):
    """``(out, lse)``: attention of the local queries over every rank's block, and the
    log-sum-exp of each query's scores ``[b, g, r, t]``."""
    size = collectives.axis_size(axis)
    b, t, n, d = q.shape
    g = k.shape[2]
    shape = (b, g, n // g, t)
    wide = wide_float(q.dtype)
    init = _like(q, k, v, positions, segments)(
        (jnp.full(shape, -jnp.inf, wide), jnp.zeros(shape, wide),
         jnp.zeros(shape + (d,), wide)))

    def fold(carry, block):
        running_max, total, acc = carry
        k_blk, v_blk, k_pos, k_seg = block
        allowed = _block_mask(positions, segments, k_pos, k_seg, window)

        def update(_):
            scores = jnp.where(allowed, _block_scores(q, k_blk, scale), -jnp.inf)
            new_max = jnp.maximum(running_max, scores.max(-1))
            safe = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
            probs = jnp.where(allowed, jnp.exp(scores - safe[..., None]), 0.0)
            rescale = jnp.exp(jnp.where(jnp.isfinite(running_max), running_max - safe, -jnp.inf))
            values = jnp.einsum("bgrts,bsgd->bgrtd", probs, v_blk.astype(wide))
            return (new_max, total * rescale + probs.sum(-1),
                    acc * rescale[..., None] + values)

        # A block none of whose keys these queries may see costs nothing.
        return jax.lax.cond(allowed.any(), update, lambda _: carry, None)

    carry, block = init, (k, v, positions, segments)
    for step in range(size):
        carry = fold(carry, block)
        if step + 1 < size:
            block = collectives.shift(block, axis)
    running_max, total, acc = carry
    out = acc / total[..., None]  # Every query sees at least itself: total > 0.
    lse = running_max + jnp.log(total)
    out = jnp.moveaxis(out, 3, 1).reshape(b, t, n, d)  # [b, g, r, t, d] -> [b, t, n, d]
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _ring(q, k, v, positions, segments, axis, scale, window):
    return _ring_forward(q, k, v, positions, segments, axis, scale, window)[0]


def _ring_fwd(q, k, v, positions, segments, axis, scale, window):
    out, lse = _ring_forward(q, k, v, positions, segments, axis, scale, window)
    return out, (q, k, v, positions, segments, out, lse)


def _ring_bwd(axis, scale, window, residuals, d_out):
    q, k, v, positions, segments, out, lse = residuals
    size = collectives.axis_size(axis)
    b, t, n, d = q.shape
    g = k.shape[2]
    wide = wide_float(q.dtype)
    grouped = lambda x: jnp.moveaxis(  # noqa: E731  [b, t, n, d] -> [b, g, r, t, d]
        x.astype(wide).reshape(b, t, g, n // g, d), 1, 3)
    d_out_g, out_g = grouped(d_out), grouped(out)
    # D = rowsum(dO * O): the softmax backward's correction, per query.
    correction = jnp.sum(d_out_g * out_g, axis=-1)

    def fold(d_q, block):
        k_blk, v_blk, k_pos, k_seg, d_k, d_v = block
        allowed = _block_mask(positions, segments, k_pos, k_seg, window)

        def update(_):
            scores = _block_scores(q, k_blk, scale)
            probs = jnp.where(allowed, jnp.exp(scores - lse[..., None]), 0.0)
            d_probs = jnp.einsum("bgrtd,bsgd->bgrts", d_out_g, v_blk.astype(wide))
            d_scores = probs * (d_probs - correction[..., None]) * scale
            qg = grouped(q)
            return (d_q + jnp.einsum("bgrts,bsgd->bgrtd", d_scores, k_blk.astype(wide)),
                    d_k + jnp.einsum("bgrts,bgrtd->bsgd", d_scores, qg),
                    d_v + jnp.einsum("bgrts,bgrtd->bsgd", probs, d_out_g))

        d_q, d_k, d_v = jax.lax.cond(allowed.any(), update, lambda _: (d_q, d_k, d_v), None)
        return d_q, (k_blk, v_blk, k_pos, k_seg, d_k, d_v)

    typed = _like(q, k, v, positions, segments, d_out, lse)
    zeros = typed(jnp.zeros(k.shape, wide))
    d_q = typed(jnp.zeros((b, g, n // g, t, d), wide))
    block = (k, v, positions, segments, zeros, zeros)
    for step in range(size):
        d_q, block = fold(d_q, block)
        # The block and its gradients move on; after the C-th move the gradients are home.
        block = (collectives.shift(block, axis) if step + 1 < size
                 else block[:4] + collectives.shift(block[4:], axis))
    d_k, d_v = block[4], block[5]
    d_q = jnp.moveaxis(d_q, 3, 1).reshape(b, t, n, d)
    return (d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _like(*values):
    """Casts a loop's starting values to vary over every mesh axis ``values`` vary over: a
    skipped block (``lax.cond``) returns them as they are, the other branch as computed."""
    axes = tuple(sorted(set().union(*(collectives.varying_axes(x) for x in values))))
    return lambda tree: collectives.cast_varying(tree, axes) if axes else tree


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
