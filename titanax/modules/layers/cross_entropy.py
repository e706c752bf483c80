"""Softmax cross-entropy over logits that may be split over the vocabulary.

With the vocabulary split over a mesh axis (TP) each device holds ``[..., V / tp]`` logits. The loss needs
only three reductions over the axis, each of ``[...]`` (one number per token), never the logits:
the max (for stability), the sum of exponentials, and the target's logit (held by exactly one
device). On one device, or with the axis absent, the same function is ordinary cross-entropy.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp

from titanax.parallel.axis_binding import active_axis
from titanax.parallel import collectives
from titanax.utils.dtypes import at_least_float32


def vocab_parallel_cross_entropy(logits: jax.Array, targets: jax.Array, *,
                                 vocab_axis: Optional[str] = None,
                                 vocab_offset: Union[int, jax.Array] = 0,
                                 vocab_size: Optional[int] = None) -> jax.Array:
    """Per-token ``-log softmax(logits)[target]`` in float32 (float64 for float64 logits).

    Args:
        logits: ``[..., V_local]``, this device's slice of the vocabulary.
        targets: ``[...]`` integer ids in the *global* vocabulary.
        vocab_axis: The axis the vocabulary is split over (None: not split).
        vocab_offset: Global id of this device's first logit.
        vocab_size: The real vocabulary size; logits of padding ids (>= vocab_size) are ignored.
    """
    loss, _, _ = _cross_entropy(logits, targets, vocab_axis=vocab_axis,
                                vocab_offset=vocab_offset, vocab_size=vocab_size)
    return loss


def vocab_parallel_scores(logits: jax.Array, targets: jax.Array, *,
                          vocab_axis: Optional[str] = None,
                          vocab_offset: Union[int, jax.Array] = 0,
                          vocab_size: Optional[int] = None) -> Tuple[jax.Array, jax.Array]:
    """``(per-token -log softmax(logits)[target], whether the target's logit is the largest)``
    -- the cross-entropy (``vocab_parallel_cross_entropy``'s), and whether greedy decoding
    (argmax: the first of tied ids) would have chosen the target. An evaluation's scores: a
    training loss calls ``vocab_parallel_cross_entropy``, without the flag's passes and
    collectives."""
    loss, logits, target_logit = _cross_entropy(logits, targets, vocab_axis=vocab_axis,
                                                vocab_offset=vocab_offset, vocab_size=vocab_size)
    split = active_axis(vocab_axis) is not None
    # Greedy decoding takes the first id of the largest logit: the target is chosen when it
    # beats every lower id and ties-or-beats every higher one.
    ids = vocab_offset + jnp.arange(logits.shape[-1])
    fixed = jax.lax.stop_gradient(logits)  # (A flag: no gradient, and pmax has no rule.)
    below = jnp.max(jnp.where(ids < targets[..., None], fixed, -jnp.inf), axis=-1)
    above = jnp.max(jnp.where(ids > targets[..., None], fixed, -jnp.inf), axis=-1)
    target_fixed = jax.lax.stop_gradient(target_logit)
    if split:
        below, above = collectives.pmax(below, vocab_axis), collectives.pmax(above, vocab_axis)
    return loss, (target_fixed > below) & (target_fixed >= above)


def _cross_entropy(logits, targets, *, vocab_axis, vocab_offset, vocab_size):
    """``(loss, the logits as compared -- float32 or wider, padding ids at -inf --, the
    target's logit)``."""
    logits = at_least_float32(logits)
    local_vocab = logits.shape[-1]
    split = active_axis(vocab_axis) is not None
    padded = local_vocab * (collectives.axis_size(vocab_axis) if split else 1)
    if vocab_size is not None and vocab_size < padded:  # (A pass over the logits: only when
        ids = vocab_offset + jnp.arange(local_vocab)    # the table has padding rows.)
        logits = jnp.where(ids < vocab_size, logits, -jnp.inf)
    # The max only shifts for stability; its gradient contribution cancels, so stop it.
    local_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    top = collectives.pmax(local_max, vocab_axis) if split else local_max
    sum_exp = jnp.sum(jnp.exp(logits - top[..., None]), axis=-1)
    local_targets = targets - vocab_offset
    held = (local_targets >= 0) & (local_targets < local_vocab)
    target_logit = jnp.take_along_axis(
        logits, jnp.where(held, local_targets, 0)[..., None], axis=-1)[..., 0]
    target_logit = jnp.where(held, target_logit, 0.0)
    if split:
        sum_exp, target_logit = collectives.psum((sum_exp, target_logit), vocab_axis)
    return jnp.log(sum_exp) + top - target_logit, logits, target_logit
