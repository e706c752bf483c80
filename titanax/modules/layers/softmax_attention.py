"""Softmax attention under an explicit mask, the S x S probabilities written out.

The one written-out attention both attention paths share: the decoder's (``layers/attention.py``:
``implementation="dense"``, which attention dropout needs) and context parallelism's
(``modules/layers/context_attention.py``) -- and ``with_sinks``: the attention sinks' factor on
an output whose log-sum-exp the blockwise pass computed (``blockwise_attention.py`` applies it).

Off a GPU, ``jax.nn.dot_product_attention`` is this same XLA math, vmapped over each kv head's
group of query heads; without grouped queries that leaves a unit group dimension in the scores,
whose backward XLA:CPU lays out through extra transposes: 2% of a GPT step
(``benchmarks/step_speed.py``, large 8x1, profiled against the plain-JAX peer). Here the group
dimension exists only where there is a group.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from titanax.utils.dtypes import lowest, wide_float


def masked_attention(q, k, v, allowed, *, scale: float,
                     dropout: Optional[Callable[[jax.Array], jax.Array]] = None,
                     sinks: Optional[jax.Array] = None) -> jax.Array:
    """Attention of ``q`` ``[b, t, n, d]`` over ``k``/``v`` ``[b, s, g, d]`` (``g`` dividing
    ``n``) where ``allowed`` (broadcastable to ``[b, 1, t, s]``) holds; scores and softmax in
    float32 or wider. ``dropout`` is applied to the probabilities. ``sinks`` ``[n]``: per head,
    a logit that joins every query's softmax as a key without a value (gpt-oss)."""
    allowed = jnp.asarray(allowed)
    allowed = allowed.reshape((1,) * (4 - allowed.ndim) + allowed.shape)  # [b | 1, 1, t, s]
    group = q.shape[2] // k.shape[2]
    if group == 1:  # As many kv heads as query heads: scores [b, n, t, s].
        scores = jnp.einsum("btnd,bsnd->bnts", q, k, preferred_element_type=wide_float(q.dtype))
    else:  # Queries grouped by the kv head they read: scores [b, g, q, t, s].
        qg = q.reshape(q.shape[:2] + (k.shape[2], group, q.shape[3]))
        scores = jnp.einsum("btgqd,bsgd->bgqts", qg, k,
                            preferred_element_type=wide_float(q.dtype))
        allowed = allowed[:, :, None]
    scores = jnp.where(allowed, scores * scale, lowest(scores.dtype))
    if sinks is not None:  # One more column per head, dropped after the softmax.
        column = sinks.astype(scores.dtype).reshape(scores.shape[1:-2] + (1, 1))
        column = jnp.broadcast_to(column, scores.shape[:-1] + (1,))
        probs = jax.nn.softmax(jnp.concatenate([scores, column], axis=-1), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    if dropout is not None:
        probs = dropout(probs)
    if group == 1:
        return jnp.einsum("bnts,bsnd->btnd", probs.astype(v.dtype), v)
    out = jnp.einsum("bgqts,bsgd->btgqd", probs.astype(v.dtype), v)
    return out.reshape(q.shape[:3] + (v.shape[-1],))


def with_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array) -> jax.Array:
    """Attention ``out`` ``[b, t, n, d]`` of a softmax over the keys alone (log-sum-exp ``lse``
    ``[b, t, n]``) as it is with each head's sink logit in the denominator too: times
    ``Z / (Z + e^sink) = sigmoid(lse - sink)``."""
    kept = jax.nn.sigmoid(lse - sinks.astype(lse.dtype))
    return (out * kept[..., None].astype(out.dtype)).astype(out.dtype)
