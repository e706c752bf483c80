"""Per-token divergences between two models' next-token distributions over the whole vocabulary,
vocabulary-parallel: each device holds a slice of both models' logits (the same ids), and the
softmax normalisers and the sums over the vocabulary are a ``pmax`` / ``psum`` over the
vocabulary axis -- no device holds a row of either model's logits.

``kind``: ``reverse_kl`` = KL(student || teacher), ``forward_kl`` = KL(teacher || student), ``jsd``
= TRL's generalized Jensen-Shannon divergence with ``beta`` (GKD, Agarwal et al. 2024):
``beta KL(teacher || m) + (1 - beta) KL(student || m)``, ``m = beta teacher + (1 - beta)
student`` -- at ``beta`` 0 TRL takes the forward KL, at 1 the reverse, and so does this. Padded
vocabulary ids (the table's rows past ``vocab_size``) count nowhere: they are masked with a
``where`` whose other branch stays finite, so no NaN reaches a gradient.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp

from titanax.parallel import collectives
from titanax.parallel.axis_binding import active_axis
from titanax.utils.dtypes import at_least_float32

KINDS = ("reverse_kl", "forward_kl", "jsd")


def vocab_parallel_divergence(student_logits: jax.Array, teacher_logits: jax.Array, *,
                              kind: str, beta: float = 0.5, temperature: float = 1.0,
                              vocab_axis: Optional[str] = None,
                              vocab_offset: Union[int, jax.Array] = 0,
                              vocab_size: Optional[int] = None) -> Tuple[jax.Array, jax.Array]:
    """``(the divergence, KL(student || teacher))`` per token, float32 or wider, of ``[...,
    V_local]`` logits (this device's slice of the vocabulary, ids from ``vocab_offset``; the
    logits divided by ``temperature``). The teacher's side takes no gradient."""
    local_vocab = student_logits.shape[-1]
    split = active_axis(vocab_axis) is not None
    padded = local_vocab * (collectives.axis_size(vocab_axis) if split else 1)
    valid = None
    if vocab_size is not None and vocab_size < padded:
        valid = (vocab_offset + jnp.arange(local_vocab)) < vocab_size
    student = _log_probs(at_least_float32(student_logits) / temperature, valid, vocab_axis)
    teacher = jax.lax.stop_gradient(
        _log_probs(at_least_float32(teacher_logits) / temperature, valid, vocab_axis))
    reverse = _kl(student, teacher, valid, vocab_axis)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1):
        return reverse, reverse
    if kind == "forward_kl" or (kind == "jsd" and beta == 0):
        return _kl(teacher, student, valid, vocab_axis), reverse
    mixture = jnp.logaddexp(student + math.log1p(-beta), teacher + math.log(beta))
    return (beta * _kl(teacher, mixture, valid, vocab_axis)
            + (1.0 - beta) * _kl(student, mixture, valid, vocab_axis)), reverse


def _log_probs(logits: jax.Array, valid: Optional[jax.Array], vocab_axis: Optional[str]
               ) -> jax.Array:
    """``log_softmax`` over the whole (split) vocabulary; padded ids hold 0, counted nowhere."""
    split = active_axis(vocab_axis) is not None
    if valid is not None:
        logits = jnp.where(valid, logits, 0.0)
    masked = logits if valid is None else jnp.where(valid, logits, -jnp.inf)
    local_max = jax.lax.stop_gradient(jnp.max(masked, axis=-1, keepdims=True))
    top = collectives.pmax(local_max, vocab_axis) if split else local_max
    exp = jnp.exp(logits - top)
    if valid is not None:
        exp = jnp.where(valid, exp, 0.0)
    total = jnp.sum(exp, axis=-1, keepdims=True)
    if split:
        total = collectives.psum(total, vocab_axis)
    return logits - top - jnp.log(total)


def _kl(p_log: jax.Array, q_log: jax.Array, valid: Optional[jax.Array],
        vocab_axis: Optional[str]) -> jax.Array:
    """``sum_v p (log p - log q)`` over the whole vocabulary."""
    terms = jnp.exp(p_log) * (p_log - q_log)
    if valid is not None:
        terms = jnp.where(valid, terms, 0.0)
    total = jnp.sum(terms, axis=-1)
    return collectives.psum(total, vocab_axis) if active_axis(vocab_axis) is not None else total
