"""Choosing each row's next token by the row's own settings: rows of different requests decode
together in a continuously batched engine, each with its temperature (0: greedy), top-p, top-k
and key. Per row this is ``titanax.modules.sampling``'s choice (greedy is the first index of the
largest logit; a temperature divides the logits; top-p keeps the smallest most likely set
reaching it), plus top-k (the k most likely; 0: all).
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp


def next_tokens(logits: jax.Array, keys: jax.Array, *, temperature: jax.Array,
                top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """``[b]`` token ids from ``[b, vocab]`` logits, row ``i`` drawn with ``keys[i]``,
    ``temperature[i]`` (0: greedy), ``top_p[i]`` and ``top_k[i]`` (0: no limit)."""
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    # (The sort only where a row filters: rows without top-p or top-k keep every token.)
    keep = jax.lax.cond(jnp.any((top_p < 1.0) | (top_k > 0)), _kept, lambda *_: jnp.ones(
        scaled.shape, bool), scaled, top_p, top_k)
    drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row))(
        keys, jnp.where(keep, scaled, -jnp.inf))
    return jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)


def _kept(scaled: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """``[b, vocab]``: the tokens each row's top-p and top-k keep."""
    order = jnp.argsort(-scaled, axis=-1)
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # Probability of the tokens ranked above.
    rank = jnp.arange(scaled.shape[-1])[None, :]
    # (top_p 1 keeps every token, as sampling.next_token: a float32 running sum reaching 1.0
    # must not drop the tail.)
    nucleus = (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep_ranked = nucleus & ((top_k[:, None] <= 0) | (rank < top_k[:, None]))
    return jnp.zeros_like(keep_ranked).at[jnp.arange(scaled.shape[0])[:, None], order].set(
        keep_ranked)


def logp_and_entropy(logits: jax.Array, tokens: jax.Array, *,
                     temperature: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """``(log p(token), entropy)`` per row under the distribution its token is drawn from
    before top-p and top-k: ``softmax(logits / temperature)`` (greedy rows: temperature 1), as
    an RL trainer scores it. Float32."""
    scaled = logits.astype(jnp.float32) / jnp.where(temperature <= 0, 1.0, temperature)[:, None]
    logps = jax.nn.log_softmax(scaled, axis=-1)
    chosen = jnp.take_along_axis(logps, tokens[:, None], axis=-1)[:, 0]
    return chosen, -jnp.sum(jnp.exp(logps) * logps, axis=-1)
