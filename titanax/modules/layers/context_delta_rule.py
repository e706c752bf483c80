"""The gated delta rule over a sequence split across a context-parallel axis.

Under context parallelism each rank holds ``pieces`` chunks of every row (``CP``'s load balance:
chunk ``r`` and ``2C-1-r`` with ``dual_chunk``, chunk ``r`` alone with ``none``), and the rule's
state must pass through the chunks in the row's order. The state after a chunk is affine in the
state before it -- each token maps ``S -> alpha_t (I - beta_t k_t k_t^T) S + beta_t k_t v_t^T`` --
so every chunk is summarised by ``S_end = T S_start + B``:

1. each rank runs the chunked rule on its chunks twice: from a zero state (``B``) and, with the
   values zeroed, from the identity (``T``, ``[d_k, d_k]`` per head);
2. one all-gather of every chunk's ``(T, B)`` (and the segment ids at its ends); each rank folds
   them in row order into every chunk's starting state (``2C`` small matrix products; a chunk
   that starts another document than the one before it ended starts from zero);
3. each rank runs the rule on its chunks from their starting states: its outputs.

The sequence is never gathered: what crosses the axis is ``[d_k, d_k + d_v]`` per head and
chunk, and memory stays linear in the local sequence. The short convolution before the rule reads
``K - 1`` tokens back, across the cuts too: ``piece_halos`` gathers every chunk's last ``K - 1``
projections (with their segment ids) and hands each chunk the ``K - 1`` before it (from several
chunks when they are shorter).
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from titanax.modules.layers.gated_delta_rule import chunked_gated_delta_rule
from titanax.parallel import collectives


def piece_order(size: int, pieces: int) -> np.ndarray:
    """``[size, pieces]``: the place in the row of each rank's local chunks (``pieces`` 2: chunk
    ``r`` then ``2 size - 1 - r``, ``CP``'s dual-chunk order; 1: chunk ``r``)."""
    ranks = np.arange(size)
    if pieces == 1:
        return ranks[:, None]
    return np.stack([ranks, 2 * size - 1 - ranks], axis=1)


def by_piece(x: jax.Array, pieces: int) -> jax.Array:
    """``[b, t, ...]`` -> ``[b * pieces, t / pieces, ...]``: each local chunk its own row."""
    b, t = x.shape[:2]
    return x.reshape((b * pieces, t // pieces) + x.shape[2:])


def _gathered(values: jax.Array, axis: str, pieces: int) -> jax.Array:
    """Every rank's ``values`` (``[b * pieces, ...]``, one per local chunk) as ``[size * pieces,
    b, ...]``, chunk ``rank * pieces + i`` (rank-major, as ``piece_order``)."""
    size = collectives.axis_size(axis)
    b = values.shape[0] // pieces
    gathered = collectives.all_gather(values.reshape((b, pieces) + values.shape[1:]), axis)
    return jnp.moveaxis(gathered, 2, 1).reshape((size * pieces, b) + values.shape[1:])


def piece_halos(y: jax.Array, segments: jax.Array, *, axis: str, pieces: int, width: int
                ) -> Tuple[jax.Array, jax.Array]:
    """The last ``width`` tokens of ``y`` (``[b, t, ...]``) before each local chunk in the row
    (reaching back over several chunks shorter than ``width``), and their segment ids (-1 where
    the row has none before): ``[b * pieces, width, ...]`` and ``[b * pieces, width]``."""
    size = collectives.axis_size(axis)
    b = y.shape[0]
    kept = min(width, y.shape[1] // pieces)  # Of each chunk, the tokens a later one may read.
    tails = _gathered(by_piece(y, pieces)[:, -kept:], axis, pieces)  # [slots, b, kept, ...]
    tail_segments = _gathered(by_piece(segments, pieces)[:, -kept:], axis, pieces)
    order = piece_order(size, pieces)
    slots = np.argsort(order.reshape(-1))  # Row position -> slot.
    # The chunks' tails in row order, one sequence per row, behind `width` tokens of nothing.
    row = jnp.moveaxis(jnp.take(tails, slots, axis=0), 0, 1).reshape((b, -1) + y.shape[2:])
    row_segments = jnp.moveaxis(jnp.take(tail_segments, slots, axis=0), 0, 1).reshape(b, -1)
    row = jnp.concatenate([jnp.zeros((b, width) + y.shape[2:], y.dtype), row], axis=1)
    row_segments = jnp.concatenate([jnp.full((b, width), -1, row_segments.dtype), row_segments],
                                   axis=1)
    places = jnp.take(jnp.asarray(order), collectives.axis_index(axis), axis=0)  # [pieces]
    halos = [(jax.lax.dynamic_slice_in_dim(row, place * kept, width, axis=1),
              jax.lax.dynamic_slice_in_dim(row_segments, place * kept, width, axis=1))
             for place in (places[i] for i in range(pieces))]
    halo = jnp.stack([h for h, _ in halos], axis=1).reshape((b * pieces, width) + y.shape[2:])
    halo_segments = jnp.stack([s for _, s in halos], axis=1).reshape(b * pieces, width)
    return halo, halo_segments


def context_parallel_gated_delta_rule(q, k, v, g, beta, *, axis: str, pieces: int,
                                      chunk_size: int,
                                      segment_ids: Optional[jax.Array] = None) -> jax.Array:
    """``chunked_gated_delta_rule``'s outputs ``[b, t, h, d_v]`` for this rank's ``t`` tokens of
    rows split over ``axis`` (``pieces`` chunks each, in ``piece_order``); the module docstring
    says how the state crosses."""
    b, t, heads, d_v = v.shape
    d_k = k.shape[-1]
    segments = (jnp.zeros((b, t), jnp.int32) if segment_ids is None
                else jnp.asarray(segment_ids, jnp.int32))
    q, k, v, g, beta, segments = (by_piece(x, pieces) for x in (q, k, v, g, beta, segments))

    def rule(values, initial_state=None):
        return chunked_gated_delta_rule(q, k, values, g, beta, chunk_size=chunk_size,
                                        initial_state=initial_state, segment_ids=segments)

    _, written = rule(v)  # B: the chunk's end state from a zero start.
    eye = jnp.broadcast_to(jnp.eye(d_k, dtype=written.dtype), written.shape[:2] + (d_k, d_k))
    _, transition = rule(jnp.zeros(v.shape[:-1] + (d_k,), v.dtype), eye)  # T
    starts = _starting_states(transition, written, segments, axis=axis, pieces=pieces)
    outputs, _ = rule(v, starts)
    return outputs.reshape(b, t, heads, d_v)


def _starting_states(transition, written, segments, *, axis: str, pieces: int) -> jax.Array:
    """Every local chunk's starting state from all chunks' ``(T, B)``: folded in row order, zero
    at the row's start and where a chunk starts another document than the one before it
    ended."""
    size = collectives.axis_size(axis)
    ends = jnp.stack([segments[:, 0], segments[:, -1]], axis=-1)  # [b * pieces, 2]
    transition_all, written_all, ends_all = (_gathered(m, axis, pieces)
                                             for m in (transition, written, ends))
    order = piece_order(size, pieces)
    slot = {int(order[r, i]): r * pieces + i for r in range(size) for i in range(pieces)}
    state = jnp.zeros_like(written_all[0])
    starts = [None] * (size * pieces)
    for j in range(size * pieces):  # Row order.
        here = slot[j]
        if j:  # The document carries on from the chunk before, or starts afresh.
            same = ends_all[slot[j - 1], :, 1] == ends_all[here, :, 0]
            state = jnp.where(same[:, None, None, None], state, 0.0)
        starts[here] = state
        state = jnp.einsum("bhij,bhjv->bhiv", transition_all[here], state) + written_all[here]
    stacked = jnp.stack(starts)  # [size * pieces, b, h, d_k, d_v], by slot
    mine = collectives.axis_index(axis) * pieces + jnp.arange(pieces)
    local = jnp.take(stacked, mine, axis=0)  # [pieces, b, ...]
    return jnp.moveaxis(local, 0, 1).reshape(written.shape)
