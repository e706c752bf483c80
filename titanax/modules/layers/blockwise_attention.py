"""Attention in O(S) memory: query blocks against key blocks with an online softmax.

Written-out attention (``softmax_attention.py``) holds a ``[t, s]`` score matrix per head, and
its backward keeps the probabilities: temp memory grows 4x per doubling of the sequence. Here
the queries go in blocks of ``block_q`` and, for each, the keys in blocks of ``block_k``: a
running maximum, sum and weighted value sum per query fold each key block in (flash attention's
online softmax), so only one ``[block_q, block_k]`` tile of scores exists at a time. The backward
(a custom VJP) keeps the output and each query's log-sum-exp and recomputes every tile's
probabilities from them (flash attention 2's backward): memory is O(S) both ways.

Which key a query sees is computed from token positions and document ids (causal by position,
same document, within the sliding window, and, decoding, only filled cache slots), so a tile none
of whose keys any of its queries may see is never visited: each query block loops over its
visible key blocks only (a loop of data-dependent length), and each key block, in the backward,
over the query blocks that see it. Causal attention does about half the tiles, a sliding window
and packed documents fewer still. (Skipping by ``lax.cond`` in a fixed-length scan made jax,
with the layers under ``lax.scan``, keep every tile's probabilities: O(S^2) again.) Grouped-query attention reads
each kv head once for its group of query heads (no repeated K/V).

Plain JAX, so it runs (and is parity-tested) on any backend: the portable implementation behind
``attention_implementation="blockwise"``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from titanax.modules.layers.softmax_attention import with_sinks
from titanax.parallel import collectives
from titanax.utils.dtypes import wide_float

# From this many keys on, blockwise attention is what "auto" picks off a GPU's fused kernel (and
# context parallelism's all-gather / Ulysses strategies): below, the written-out scores are small.
BLOCKWISE_FROM = 1024

# A key position no query sees (padding keys up to a whole block).
_NEVER = jnp.iinfo(jnp.int32).max


def blockwise_attention(q, k, v, *, scale: float, q_positions, k_positions,
                        q_segments=None, k_segments=None, sliding_window: Optional[int] = None,
                        kv_length=None, block_q: int = 512, block_k: int = 512,
                        sinks: Optional[jax.Array] = None):
    """Attention of ``q`` ``[b, t, n, d]`` over ``k``/``v`` ``[b, s, g, d]`` (``g`` dividing
    ``n``), ``[b, t, n, d]`` out. A query sees a key when the key's position is not after its
    own, both carry the same segment id (when given: ``[b, t]`` / ``[b, s]``), the key is within
    ``sliding_window`` positions, and its index is below ``kv_length`` (a cache's filled part).
    Positions ``[t]`` / ``[s]`` or ``[b, t]`` / ``[b, s]``. A query that sees no key (padding)
    gets zeros. Sequences that blocks do not divide are padded with keys no query sees.
    ``sinks`` ``[n]``: each head's sink logit in every query's softmax denominator (gpt-oss's),
    applied through the queries' log-sum-exp, which is differentiable."""
    b, t, _, _ = q.shape
    s = k.shape[1]
    q_pos = jnp.broadcast_to(jnp.asarray(q_positions, jnp.int32), (b, t))
    k_pos = jnp.broadcast_to(jnp.asarray(k_positions, jnp.int32), (b, s))
    if kv_length is not None:  # Unfilled cache slots: keys no query sees.
        k_pos = jnp.where(jnp.arange(s) < kv_length, k_pos, _NEVER)
    q_seg = jnp.zeros((b, t), jnp.int32) if q_segments is None else q_segments.astype(jnp.int32)
    k_seg = jnp.zeros((b, s), jnp.int32) if k_segments is None else k_segments.astype(jnp.int32)
    block_q, block_k = min(block_q, t), min(block_k, s)
    q, q_pos, q_seg = padded_queries(q, q_pos, q_seg, block_q)
    k, v, k_pos, k_seg = padded_keys(k, v, k_pos, k_seg, block_k)
    out, lse = _attention(q, k, v, q_pos, k_pos, q_seg, k_seg,
                          Static(float(scale), sliding_window, block_q, block_k))
    if sinks is None:
        return out[:, :t]
    # [b, g, r, t] -> [b, t, g * r]
    lse = jnp.moveaxis(lse, 3, 1).reshape(lse.shape[0], lse.shape[3], -1)
    return with_sinks(out[:, :t], lse[:, :t], sinks)


class Static(NamedTuple):
    """The kernel's static arguments (hashable: custom_vjp's nondiff argument): the score
    scale, the sliding window (None: none), and the query and key block lengths."""

    scale: float
    window: Optional[int]
    block_q: int
    block_k: int


# --- Tiles -----------------------------------------------------------------------------------------

def _blocks(x, size):
    """``[b, n * size, ...]`` -> ``[n, b, size, ...]`` (the blocks a loop runs over)."""
    return jnp.moveaxis(x.reshape((x.shape[0], x.shape[1] // size, size) + x.shape[2:]), 1, 0)


def unblocked(x):
    """The inverse of ``_blocks``: ``[n, b, size, ...]`` -> ``[b, n * size, ...]``."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


def _grouped(x, groups):
    """``[b, t, g*r, d]`` -> ``[b, g, r, t, d]`` in float32 or wider."""
    b, t, n, d = x.shape
    return jnp.moveaxis(x.astype(wide_float(x.dtype)).reshape(b, t, groups, n // groups, d), 1, 3)


def _ungrouped(x):
    """``[b, g, r, t, d]`` -> ``[b, t, g*r, d]``."""
    b, g, r, t, d = x.shape
    return jnp.moveaxis(x, 3, 1).reshape(b, t, g * r, d)


def _tile_mask(q_pos, q_seg, k_pos, k_seg, window):
    """``[b, 1, 1, bq, bk]``: which key of the tile each query sees."""
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    allowed = (kp <= qp) & (q_seg[:, :, None] == k_seg[:, None, :])
    if window is not None:
        allowed &= kp > qp - window
    return allowed[:, None, None]


def _tile_scores(qg, k_blk, scale):
    """``[b, g, r, bq, bk]`` scores of grouped queries ``[b, g, r, bq, d]`` (float32 or wider)
    against keys ``[b, bk, g, d]``."""
    return jnp.einsum("bgrtd,bsgd->bgrts", qg, k_blk.astype(qg.dtype)) * scale


def _tile_visible(q_pos, q_seg, k_pos, k_seg, window):
    """Whether any query of the tile may see any of its keys, from the tile's position and
    document-id ranges (cheap: no [bq, bk] mask). Conservative: a tile it admits may still be
    fully masked (rows whose ranges differ), never the other way round."""
    overlap = (jnp.min(k_seg) <= jnp.max(q_seg)) & (jnp.min(q_seg) <= jnp.max(k_seg))
    q_valid = q_pos >= 0
    q_max = jnp.max(jnp.where(q_valid, q_pos, -1))
    q_min = jnp.min(jnp.where(q_valid, q_pos, _NEVER))
    k_min = jnp.min(k_pos)
    k_max = jnp.max(jnp.where(k_pos == _NEVER, -1, k_pos))
    visible = overlap & (k_min <= q_max)
    if window is not None:
        visible &= k_max > q_min - window
    return visible


# --- Forward -------------------------------------------------------------------------------------

def _visible_blocks(pos, seg, blocks_pos, blocks_seg, window, *, keys_of_queries=False):
    """``(order, count)``: the indices of the blocks of ``blocks_*`` (``[n, b, block]``) that
    share a visible tile with the tokens ``pos`` / ``seg`` -- key blocks these queries may see,
    or (``keys_of_queries``) query blocks that may see these keys -- first in ``order``, and
    how many there are."""
    if keys_of_queries:
        tile = lambda qp, qs: _tile_visible(qp, qs, pos, seg, window)  # noqa: E731
    else:
        tile = lambda kp, ks: _tile_visible(pos, seg, kp, ks, window)  # noqa: E731
    visible = jax.vmap(tile)(blocks_pos, blocks_seg)
    order = jnp.argsort(~visible, stable=True)  # The visible blocks first, in their order.
    return order, jnp.sum(visible, dtype=jnp.int32)


def padded_queries(q, q_pos, q_seg, block: int):
    """``q`` / positions / segments padded to a whole number of ``block``-long query blocks
    (padding queries sit at position -1: they see no key)."""
    pad = -q.shape[1] % block
    if not pad:
        return q, q_pos, q_seg
    return (jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))),
            jnp.pad(q_pos, ((0, 0), (0, pad)), constant_values=-1),
            jnp.pad(q_seg, ((0, 0), (0, pad))))


def padded_keys(k, v, k_pos, k_seg, block: int):
    """Keys / values / positions / segments padded to whole ``block``-long key blocks (padding
    keys sit at a position no query reaches)."""
    pad = -k.shape[1] % block
    if not pad:
        return k, v, k_pos, k_seg
    k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (k, v))
    return (k, v, jnp.pad(k_pos, ((0, 0), (0, pad)), constant_values=_NEVER),
            jnp.pad(k_seg, ((0, 0), (0, pad))))


def empty_state(q, groups: int, block_q: int, *, like=()):
    """The online softmax's starting state of the (padded) queries ``q`` ``[b, t, g*r, d]``, per
    query block: running maximum and sum ``[nq, b, g, r, bq]``, weighted values
    ``[nq, b, g, r, bq, d]`` (cast to vary as ``q`` and ``like`` do, inside a shard_map)."""
    b, t, n, d = q.shape
    shape = (t // block_q, b, groups, n // groups, block_q)
    wide = wide_float(q.dtype)
    return cast_like(q, *like)((jnp.full(shape, -jnp.inf, wide), jnp.zeros(shape, wide),
                            jnp.zeros(shape + (d,), wide)))


def fold_keys(state, q, q_pos, q_seg, k, v, k_pos, k_seg, static: "Static"):
    """``state`` with the keys ``k``/``v`` (any number of whole ``block_k`` blocks) folded into
    every query block's online softmax, tile by tile, visiting only the key blocks each query
    block may see. Queries and keys padded to whole blocks (``padded_queries``/``padded_keys``).
    Context parallelism's ring folds each visiting block in with this."""
    groups = k.shape[2]
    wide = wide_float(q.dtype)
    k_blocks = tuple(_blocks(x, static.block_k) for x in (k, v, k_pos, k_seg))

    def one_query_block(args):
        q_blk, qp, qs, carry = args
        qg = _grouped(q_blk, groups)  # [b, g, r, bq, d]
        order, count = _visible_blocks(qp, qs, k_blocks[2], k_blocks[3], static.window)

        def fold(step, carry):
            k_blk, v_blk, kp, ks = (x[order[step]] for x in k_blocks)
            running_max, total, acc = carry
            allowed = _tile_mask(qp, qs, kp, ks, static.window)
            scores = jnp.where(allowed, _tile_scores(qg, k_blk, static.scale), -jnp.inf)
            new_max = jnp.maximum(running_max, scores.max(-1))
            safe = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
            probs = jnp.exp(scores - safe[..., None])  # exp(-inf) = 0 where masked.
            rescale = jnp.exp(jnp.where(jnp.isfinite(running_max), running_max - safe,
                                        -jnp.inf))
            values = jnp.einsum("bgrts,bsgd->bgrtd", probs, v_blk.astype(wide))
            return (new_max, total * rescale + probs.sum(-1), acc * rescale[..., None] + values)

        # Only the visible key blocks (a loop of data-dependent length: masked tiles cost
        # nothing, and the loop is never differentiated, only the custom VJP below).
        return jax.lax.fori_loop(0, count, fold, carry)

    q_blocks = tuple(_blocks(x, static.block_q) for x in (q, q_pos, q_seg))
    return jax.lax.map(one_query_block, q_blocks + (state,))


def finish(state, dtype):
    """``(out [b, t, n, d], lse [b, g, r, t])`` from a folded state: the attention and each
    query's log-sum-exp of its visible scores (zeros and -inf for a query that saw none)."""
    running_max, total, acc = state
    seen = total > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, total, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, running_max + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    # [nq, b, g, r, bq, d] -> [b, t, n, d]; [nq, b, g, r, bq] -> [b, g, r, t].
    out = jax.vmap(_ungrouped)(out)
    return unblocked(out).astype(dtype), jnp.moveaxis(lse, 0, 3).reshape(lse.shape[1:4] + (-1,))


def _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, static: Static):
    """``(out [b, t, n, d], lse [b, g, r, t])`` of the padded queries over the padded keys."""
    state = empty_state(q, k.shape[2], static.block_q, like=(k, v, q_pos, k_pos))
    return finish(fold_keys(state, q, q_pos, q_seg, k, v, k_pos, k_seg, static), q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q, k, v, q_pos, k_pos, q_seg, k_seg, static):
    return _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, static)


def _attention_fwd(q, k, v, q_pos, k_pos, q_seg, k_seg, static):
    out, lse = _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, static)
    return (out, lse), (q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse)


# --- Backward: every tile's probabilities recomputed from the log-sum-exp --------------------------

def query_grad_blocks(q, q_pos, q_seg, d_out, out, lse, block_q: int, d_lse=None):
    """What the backward reads per query block, blocked: q, positions, segments, dO, and each
    query's log-sum-exp and softmax correction D = rowsum(dO * O) - dlse (``[nq, b, bq, g,
    r]``; ``d_lse`` ``[b, g, r, t]``: the log-sum-exp's own cotangent, whose gradient on the
    scores is the probabilities times it)."""
    groups = lse.shape[1]
    correction = jnp.sum(_grouped(d_out, groups) * _grouped(out, groups), axis=-1)
    if d_lse is not None:
        correction = correction - jnp.where(jnp.isfinite(lse), d_lse, 0.0).astype(
            correction.dtype)
    return (_blocks(q, block_q), _blocks(q_pos, block_q), _blocks(q_seg, block_q),
            _blocks(d_out, block_q), _blocks(jnp.moveaxis(lse, 3, 1), block_q),
            _blocks(jnp.moveaxis(correction, 3, 1), block_q))


def fold_key_grads(d_q, q_blocks, k, v, k_pos, k_seg, static: "Static"):
    """``(d_q, d_k, d_v)``: ``d_q`` (blocked ``[nq, b, bq, n, d]``, float32 or wider) plus the
    keys' share of the queries' gradient, and the keys' own gradients, each tile's
    probabilities recomputed from the saved log-sum-exp; each key block visits only the query
    blocks that see it. ``q_blocks``: ``query_grad_blocks``. The ring folds each visiting block
    with this."""
    groups = k.shape[2]
    wide = wide_float(k.dtype)
    typed = cast_like(d_q, k, v, *q_blocks)

    def one_key_block(d_q, block):
        k_blk, v_blk, kp, ks = block
        zeros = typed(jnp.zeros(k_blk.shape, wide))
        order, count = _visible_blocks(kp, ks, q_blocks[1], q_blocks[2], static.window,
                                       keys_of_queries=True)

        def fold(step, carry):
            d_k, d_v, d_q = carry
            index = order[step]
            q_blk, qp, qs, do_blk, lse_blk, corr_blk = (x[index] for x in q_blocks)
            qg, dog = _grouped(q_blk, groups), _grouped(do_blk, groups)
            lse_blk, corr_blk = jnp.moveaxis(lse_blk, 1, 3), jnp.moveaxis(corr_blk, 1, 3)
            allowed = _tile_mask(qp, qs, kp, ks, static.window)
            scores = _tile_scores(qg, k_blk, static.scale)
            safe_lse = jnp.where(jnp.isfinite(lse_blk), lse_blk, 0.0)
            probs = jnp.where(allowed, jnp.exp(scores - safe_lse[..., None]), 0.0)
            d_probs = jnp.einsum("bgrtd,bsgd->bgrts", dog, v_blk.astype(wide))
            d_scores = probs * (d_probs - corr_blk[..., None]) * static.scale
            d_q_blk = _ungrouped(jnp.einsum("bgrts,bsgd->bgrtd", d_scores, k_blk.astype(wide)))
            return (d_k + jnp.einsum("bgrts,bgrtd->bsgd", d_scores, qg),
                    d_v + jnp.einsum("bgrts,bgrtd->bsgd", probs, dog),
                    d_q.at[index].add(d_q_blk))

        d_k, d_v, d_q = jax.lax.fori_loop(0, count, fold, (zeros, zeros, d_q))
        return d_q, (d_k, d_v)

    k_blocks = tuple(_blocks(x, static.block_k) for x in (k, v, k_pos, k_seg))
    d_q, (d_k, d_v) = jax.lax.scan(one_key_block, d_q, k_blocks)
    return d_q, unblocked(d_k), unblocked(d_v)


def _attention_bwd(static: Static, residuals, cotangents):
    q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse = residuals
    d_out, d_lse = cotangents
    q_blocks = query_grad_blocks(q, q_pos, q_seg, d_out, out, lse, static.block_q, d_lse)
    d_q0 = cast_like(q, k, v, d_out, lse)(jnp.zeros(q_blocks[0].shape, wide_float(q.dtype)))
    d_q, d_k, d_v = fold_key_grads(d_q0, q_blocks, k, v, k_pos, k_seg, static)
    return (unblocked(d_q).astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype),
            None, None, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def cast_like(*values):
    """Casts loop starting values to vary over every mesh axis ``values`` vary over (inside a
    ``shard_map``): a loop's carry keeps one type, and zeros start typed invariant."""
    axes = tuple(sorted(set().union(*(collectives.varying_axes(x) for x in values))))
    return lambda tree: collectives.cast_varying(tree, axes) if axes else tree
