"""Token losses computed a chunk of tokens at a time: the full logits never exist.

At Llama 3's vocabulary a row of 4,096 tokens has 4096 x 128,256 logits: 2 GiB in float32, and
the backward keeps them (and the softmax) for the gradient. Here the tokens go through the LM
head and the loss in chunks under ``lax.scan``, each chunk's body under ``jax.checkpoint``: the
forward keeps only each chunk's loss, and the backward recomputes one chunk's logits at a time
(the head's weight gradient summed across chunks by the scan). Temp memory is then one chunk's
logits, whatever the sequence length, for about one extra head matmul of compute (the recompute).

The body is any ``(hidden chunk, target chunk) -> per-token losses``: the vocabulary-parallel
cross-entropy under tensor parallelism works per chunk as on the whole (its three reductions are
per token), and per-token log-probabilities are its negation (what preference and RL losses read).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

# Logits one chunk may hold: 2^24 elements (64 MiB in float32) unless a chunk length is given.
LOGITS_PER_CHUNK = 1 << 24


def chunk_length(*, tokens: int, local_vocab: int, requested: Optional[int] = None) -> int:
    """Tokens per chunk: ``requested``, else as many as keep a chunk's logits within
    LOGITS_PER_CHUNK elements (all of them when they fit: no scan at small vocabularies)."""
    chunk = requested if requested is not None else max(1, LOGITS_PER_CHUNK // local_vocab)
    return max(1, min(chunk, tokens))


def chunked_token_losses(hidden: jax.Array, targets: jax.Array, *,
                         loss_of_chunk: Callable[[jax.Array, jax.Array], jax.Array],
                         chunk: int) -> jax.Array:
    """``loss_of_chunk(hidden [n, d], targets [n]) -> [n, *k]`` over ``hidden`` ``[..., d]`` /
    ``targets`` ``[...]`` in chunks of ``chunk`` tokens; returns ``[..., *k]`` (``k``: values
    per token, usually none). A chunk length that does not divide the tokens pads the last
    chunk (its padding's values are dropped)."""
    lead = targets.shape
    tokens = int(targets.size)
    flat_hidden = hidden.reshape(tokens, hidden.shape[-1])
    flat_targets = targets.reshape(tokens)
    if chunk >= tokens:
        out = loss_of_chunk(flat_hidden, flat_targets)
        return out.reshape(lead + out.shape[1:])
    pad = -tokens % chunk
    if pad:
        flat_hidden = jnp.pad(flat_hidden, ((0, pad), (0, 0)))
        flat_targets = jnp.pad(flat_targets, (0, pad))
    chunks = (flat_hidden.reshape(-1, chunk, hidden.shape[-1]), flat_targets.reshape(-1, chunk))
    body = jax.checkpoint(loss_of_chunk, prevent_cse=False)
    _, losses = jax.lax.scan(lambda carry, xs: (carry, body(*xs)), None, chunks)
    per_token = losses.shape[2:]
    return losses.reshape((-1,) + per_token)[:tokens].reshape(lead + per_token)
