"""The gated delta rule (Gated DeltaNet's linear attention: Qwen 3.5, Qwen3-Next) in plain JAX:
token by token for decoding, and in chunks for training, in O(S) memory.

Each head keeps a state ``S`` of ``[d_k, d_v]`` -- an associative memory from keys to values --
and for every token ``t``, with a decay ``alpha_t = exp(g_t)`` (``g_t <= 0``) and a write
strength ``beta_t`` in ``(0, 1)``::

    S <- alpha_t S                               (forget a little of everything)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T      (the delta rule: move S^T k_t towards v_t)
    o_t = S^T (q_t / sqrt(d_k))

Token by token (``recurrent_gated_delta_rule``, one ``gated_delta_step`` per token) is what
decoding runs, its state carried in the cache; over a whole sequence it is a loop of ``S`` tiny
steps, which training cannot afford. ``chunked_gated_delta_rule`` computes the same outputs in
chunks of ``C`` tokens: within a chunk, the corrections ``u_t = beta_t (v_t - ...)`` every token
writes depend on the earlier ones through a unit lower-triangular ``[C, C]`` system (solved by
matrix products instead of ``C`` steps: ``_unit_lower_inverse``), and the state passes from
chunk to chunk. So a chunk costs matrix products of ``[C, C]`` and ``[C, d]``, and memory is O(S * C) at most -- the
chunk body is rematerialised in the backward, which then keeps one ``[d_k, d_v]`` state per
chunk and the inputs: O(S) (measured in tests/modules/layers/test_gated_delta_rule.py).

Derivation (one chunk, ``S0`` the state it starts from, ``G_t`` the cumulative sum of ``g``
within the chunk, ``D[t, s] = exp(G_t - G_s)`` for ``s <= t``, else 0)::

    u_t = beta_t (v_t - exp(G_t) S0^T k_t - sum_{s<t} D[t, s] (k_s . k_t) u_s)
    o_t = exp(G_t) S0^T q_t + sum_{s<=t} D[t, s] (k_s . q_t) u_s
    S_C = exp(G_C) S0 + sum_s D[C, s] k_s u_s^T

The first line is ``(I + A) U = beta V - beta exp(G) K S0`` with ``A[t, s] = beta_t D[t, s]
(k_t . k_s)`` strictly below the diagonal: ``(I + A)^-1`` applied to ``beta V`` and to ``beta
exp(G) K``, and ``U`` is their difference after the second meets ``S0``.

Packed rows (``segment_ids``): the state starts from zero at each document's first token --
the token-by-token loop clears it there, the chunked form drops every term that crosses a
document boundary (``D``, ``A`` and the carried-in state masked by segment), so a document never
reads another's memory. Computed in float32 whatever the input dtype (float64 stays float64:
``utils/dtypes.py``). Queries and keys arrive as the layer made them (the layer L2-normalises
them, as Qwen's does); heads of ``q``/``k`` may be fewer than those of ``v`` (each serves a
consecutive group of value heads, as Qwen 3.5's grouped heads).
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from titanax.parallel import collectives
from titanax.utils.dtypes import wide_float

# Tokens per chunk by default: the chunk's [C, C] products stay small (the
# flash-linear-attention kernels' and transformers' chunk size too).
DEFAULT_CHUNK_SIZE = 64


def gated_delta_step(state: jax.Array, q_t: jax.Array, k_t: jax.Array, v_t: jax.Array,
                     g_t: jax.Array, beta_t: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """One token for every row and head: ``state`` ``[b, h, d_k, d_v]``, ``q_t`` / ``k_t``
    ``[b, h, d_k]`` (``q_t`` already scaled), ``v_t`` ``[b, h, d_v]``, ``g_t`` / ``beta_t``
    ``[b, h]``. Returns ``(new state, output [b, h, d_v])``."""
    state = state * jnp.exp(g_t)[..., None, None]
    remembered = jnp.einsum("bhkv,bhk->bhv", state, k_t)
    correction = (v_t - remembered) * beta_t[..., None]
    state = state + k_t[..., :, None] * correction[..., None, :]
    return state, jnp.einsum("bhkv,bhk->bhv", state, q_t)


def recurrent_gated_delta_rule(q, k, v, g, beta, *, scale: Optional[float] = None,
                               initial_state: Optional[jax.Array] = None,
                               segment_ids: Optional[jax.Array] = None
                               ) -> Tuple[jax.Array, jax.Array]:
    """The rule token by token. ``q`` / ``k`` ``[b, s, h_k, d_k]``, ``v`` ``[b, s, h, d_v]``
    (``h_k`` dividing ``h``), ``g`` / ``beta`` ``[b, s, h]``; ``scale`` defaults to
    ``d_k ** -0.5``; ``initial_state`` ``[b, h, d_k, d_v]`` (zeros if None); ``segment_ids``
    ``[b, s]`` clears the state where the id changes. Returns ``(outputs [b, s, h, d_v] in v's
    dtype, final state [b, h, d_k, d_v] in float32 or wider)``."""
    q, k, v, g, beta, state = _prepared(q, k, v, g, beta, scale, initial_state)
    starts = _document_starts(segment_ids, v.shape[:2])

    def step(state, token):
        q_t, k_t, v_t, g_t, beta_t, start = token
        state = jnp.where(start[:, None, None, None], 0.0, state)
        return gated_delta_step(state, q_t, k_t, v_t, g_t, beta_t)

    tokens = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, starts))
    state, outputs = jax.lax.scan(step, state, tokens)
    return jnp.moveaxis(outputs, 0, 1).astype(_out_dtype(v, q)), state


def chunked_gated_delta_rule(q, k, v, g, beta, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                             scale: Optional[float] = None,
                             initial_state: Optional[jax.Array] = None,
                             segment_ids: Optional[jax.Array] = None
                             ) -> Tuple[jax.Array, jax.Array]:
    """``recurrent_gated_delta_rule``'s outputs and final state, ``chunk_size`` tokens at a time
    (the last chunk padded with tokens that neither decay nor write)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    out_dtype = _out_dtype(v, q)
    q, k, v, g, beta, state = _prepared(q, k, v, g, beta, scale, initial_state)
    b, s = v.shape[:2]
    segments = (jnp.zeros((b, s), jnp.int32) if segment_ids is None
                else jnp.asarray(segment_ids, jnp.int32))
    pad = -s % chunk_size
    if pad:  # Padding continues the last document (no reset) and changes nothing.
        q, k, v, g, beta = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
                            for x in (q, k, v, g, beta))
        segments = jnp.pad(segments, [(0, 0), (0, pad)], mode="edge")
    chunks = (s + pad) // chunk_size
    # Chunk-major for the scan: [n, b, h, C, ...] (heads before positions: batched matmuls).
    q_c, k_c, v_c = (_heads_first(x, b, chunks, chunk_size) for x in (q, k, v))
    g_c, beta_c = (_heads_first(x[..., None], b, chunks, chunk_size)[..., 0] for x in (g, beta))
    seg_c = jnp.moveaxis(segments.reshape(b, chunks, chunk_size), 1, 0)
    # The segment each chunk's incoming state belongs to: the previous chunk's last token's.
    previous = jnp.concatenate([segments[None, :, :1], seg_c[:-1, :, -1:]], axis=0)

    body = jax.checkpoint(_chunk, prevent_cse=False)
    state, outputs = jax.lax.scan(body, state, (q_c, k_c, v_c, g_c, beta_c, seg_c, previous))
    # outputs [n, b, h, C, d_v] -> [b, s, h, d_v]
    outputs = jnp.moveaxis(outputs, 0, 1)  # [b, n, h, C, d_v]
    outputs = jnp.moveaxis(outputs, 2, 3).reshape(b, chunks * chunk_size, *outputs.shape[2:3],
                                                  outputs.shape[-1])
    return outputs[:, :s].astype(out_dtype), state


def _chunk(state, chunk):
    """One chunk for every row and head (the module docstring's derivation): ``state`` ``[b, h,
    d_k, d_v]``; ``q``/``k`` ``[b, h, C, d_k]``, ``v`` ``[b, h, C, d_v]``, ``g``/``beta``
    ``[b, h, C]``, ``segments`` ``[b, C]``, ``previous`` ``[b, 1]`` (the incoming state's)."""
    q, k, v, g, beta, segments, previous = chunk
    size = g.shape[-1]
    cumulative = jnp.cumsum(g, axis=-1)  # G_t
    causal = jnp.tril(jnp.ones((size, size), bool))
    visible = causal & (segments[:, None, :, None] == segments[:, None, None, :])  # [b,1,C,C]
    exponent = cumulative[..., :, None] - cumulative[..., None, :]
    decay = jnp.where(visible, jnp.exp(jnp.where(visible, exponent, 0.0)), 0.0)  # D[t, s]
    carried = (segments == previous)[:, None, :]  # Tokens still in the incoming state's document.
    from_start = jnp.where(carried, jnp.exp(cumulative), 0.0)  # exp(G_t), 0 past a boundary
    strictly_lower = jnp.tril(jnp.ones((size, size), bool), -1)
    inverse = _unit_lower_inverse(jnp.where(
        strictly_lower, beta[..., :, None] * decay * jnp.einsum("bhtk,bhsk->bhts", k, k), 0.0))
    written = inverse @ (beta[..., None] * v)  # T beta V
    erased = inverse @ ((beta * from_start)[..., None] * k)  # T beta exp(G) K
    corrections = written - jnp.einsum("bhtk,bhkv->bhtv", erased, state)  # U
    outputs = (from_start[..., None] * jnp.einsum("bhtk,bhkv->bhtv", q, state)
               + jnp.einsum("bhts,bhsv->bhtv", decay * jnp.einsum("bhtk,bhsk->bhts", q, k),
                            corrections))
    to_end = decay[..., -1, :]  # D[C, s]
    state = (from_start[..., -1][..., None, None] * state
             + jnp.einsum("bhs,bhsk,bhsv->bhkv", to_end, k, corrections))
    return state, outputs


def _unit_lower_inverse(strict):
    """``(I + N)^-1`` for strictly lower-triangular ``N`` ``[..., C, C]`` by matrix products
    only: ``N`` is nilpotent (``N^C = 0``), so ``(I - N)(I + N^2)(I + N^4)...`` with ``2^m >= C``
    telescopes to it (``(I + N)(I - N) = I - N^2``, ...) -- ``log2(C)`` squarings and products,
    the same XLA matmuls on every backend, where a triangular solve is a LAPACK call on the CPU
    (suspected in a job of 8 simulated devices that stalled past XLA's collective rendezvous
    limit, and not a loop XLA can fuse)."""
    size = strict.shape[-1]
    eye = jnp.eye(size, dtype=strict.dtype)
    inverse, power, reach = eye - strict, strict @ strict, 2
    while reach < size:
        inverse = inverse @ (eye + power)
        power = power @ power
        reach *= 2
    return inverse


def _heads_first(x, b, chunks, chunk_size):
    """``[b, n*C, h, d]`` -> ``[n, b, h, C, d]``."""
    x = x.reshape(b, chunks, chunk_size, *x.shape[2:])
    return jnp.transpose(x, (1, 0, 3, 2, 4))


def _prepared(q, k, v, g, beta, scale, initial_state):
    """Inputs in the compute dtype, q/k heads repeated to v's, q scaled; the starting state."""
    b, _, heads, d_v = v.shape
    k_heads, d_k = k.shape[2:]
    if heads % k_heads:
        raise ValueError(f"value heads ({heads}) must be a multiple of query/key heads "
                         f"({k_heads})")
    dtype = wide_float(jnp.promote_types(q.dtype, v.dtype))
    q, k, v, g, beta = (jnp.asarray(x).astype(dtype) for x in (q, k, v, g, beta))
    if heads != k_heads:  # Each query/key head serves `group` consecutive value heads.
        q, k = (jnp.repeat(x, heads // k_heads, axis=2) for x in (q, k))
    q = q * (d_k ** -0.5 if scale is None else scale)
    state = (jnp.zeros((b, heads, d_k, d_v), dtype) if initial_state is None
             else jnp.asarray(initial_state).astype(dtype))
    # Inside shard_map the carried state varies over every mesh axis its inputs vary over.
    axes = frozenset().union(*(collectives.varying_axes(x) for x in (q, k, v, g, beta)))
    if axes - collectives.varying_axes(state):
        state = collectives.cast_varying(state, tuple(sorted(axes)))
    return q, k, v, g, beta, state


def _document_starts(segment_ids, shape):
    """``[b, s]``: True where a token starts another document than the one before it."""
    if segment_ids is None:
        return jnp.zeros(shape, bool)
    segments = jnp.asarray(segment_ids)
    return jnp.concatenate([jnp.zeros_like(segments[:, :1], bool),
                            segments[:, 1:] != segments[:, :-1]], axis=1)


def _out_dtype(v, q):
    return jnp.promote_types(jnp.asarray(q).dtype, jnp.asarray(v).dtype)
