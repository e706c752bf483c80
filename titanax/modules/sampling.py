"""Choosing the next token from logits: greedy, temperature, nucleus (top-p).

Greedy takes the first index of the largest logit (``argmax``: what transformers' greedy search
takes, so the two agree token for token). With a temperature the logits are divided by it and
sampled; ``top_p < 1`` first keeps only the smallest set of most likely tokens whose probability
reaches ``top_p`` (at least the most likely one).
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp


def next_token(logits: jax.Array, key: Optional[jax.Array], *, temperature: Optional[float],
               top_p: float = 1.0) -> jax.Array:
    """``[batch]`` token ids from ``[batch, vocab]`` logits (float32)."""
    logits = logits.astype(jnp.float32)
    if not temperature:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # Probability of the tokens ranked above.
        keep_sorted = before < top_p
        keep = jnp.zeros_like(keep_sorted).at[
            jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def token_logp_and_entropy(logits: jax.Array, token: jax.Array, *,
                           temperature: Optional[float]) -> Tuple[jax.Array, jax.Array]:
    """``(log p(token), entropy)`` per row of ``[batch, vocab]`` logits under the distribution
    a sample is drawn from before top-p: ``softmax(logits / temperature)`` (greedy: the
    temperature is 1). Float32."""
    logits = logits.astype(jnp.float32) / (temperature or 1.0)
    logps = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logps, token[:, None], axis=-1)[:, 0]
    return chosen, -jnp.sum(jnp.exp(logps) * logps, axis=-1)
