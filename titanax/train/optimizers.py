"""Optimizer and schedule factories for ``config_for_function`` (AdamW, Lion, SGD; warmup+cosine).

They differ from the optax factories they wrap in one way: weight decay is *scaled per param* by
``ParameterSpec.weight_decay_scale`` (0 for biases and norms), supplied by the learner as a tree.
Every transformation here is elementwise, so it is correct in local view on sharded params.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

from titanax.config import checked_by
from titanax.config import value_checks as check

Schedule = Callable[[jax.Array], jax.Array]
ScalarOrSchedule = Union[float, Schedule]


def decayed_weights(weight_decay: float, decay_scales: Any) -> optax.GradientTransformation:
    """``updates + weight_decay * scale * params`` with a per-param scale tree."""
    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None):
        if weight_decay == 0.0 or decay_scales is None:
            return updates, state
        new = jax.tree_util.tree_map(lambda u, p, s: u + weight_decay * s * p.astype(u.dtype),
                                     updates, params, decay_scales)
        return new, state

    return optax.GradientTransformation(init, update)


def _adam_arguments(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, **_):
    yield from check.fraction("b1", b1)
    yield from check.fraction("b2", b2)
    yield from check.positive("eps", eps)  # eps = 0 divides a zero gradient by zero.
    yield from check.at_least("weight_decay", weight_decay, 0)


def _lion_arguments(b1=0.9, b2=0.99, weight_decay=0.0, **_):
    yield from check.fraction("b1", b1)
    yield from check.fraction("b2", b2)
    yield from check.at_least("weight_decay", weight_decay, 0)


def _sgd_arguments(momentum=None, weight_decay=0.0, **_):
    yield from check.fraction("momentum", momentum, allow_none=True)
    yield from check.at_least("weight_decay", weight_decay, 0)


def _schedule_arguments(warmup_steps=0, init_value=0.0, **_):
    yield from check.at_least("warmup_steps", warmup_steps, 0)
    yield from check.at_least("init_value", init_value, 0)


@checked_by(_adam_arguments)
def adamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 0.0, *, decay_scales: Any = None) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay, scaled per param)."""
    return optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
                       decayed_weights(weight_decay, decay_scales),
                       optax.scale_by_learning_rate(learning_rate))


@checked_by(_lion_arguments)
def lion(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.99,
         weight_decay: float = 0.0, *, decay_scales: Any = None) -> optax.GradientTransformation:
    """Lion (sign of an interpolated momentum), decoupled weight decay scaled per param."""
    return optax.chain(optax.scale_by_lion(b1=b1, b2=b2),
                       decayed_weights(weight_decay, decay_scales),
                       optax.scale_by_learning_rate(learning_rate))


@checked_by(_sgd_arguments)
def sgd(learning_rate: ScalarOrSchedule, momentum: Optional[float] = None, nesterov: bool = False,
        weight_decay: float = 0.0, *, decay_scales: Any = None) -> optax.GradientTransformation:
    """SGD with optional (Nesterov) momentum and weight decay scaled per param."""
    parts = [decayed_weights(weight_decay, decay_scales)]
    if momentum:
        parts.append(optax.trace(decay=momentum, nesterov=nesterov))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)


@checked_by(_schedule_arguments)
def warmup_cosine(peak_value: float, warmup_steps: int, decay_steps: Optional[int] = None,
                  init_value: float = 0.0, end_value: float = 0.0) -> Schedule:
    """Linear warm-up from init_value to peak_value, then cosine decay to end_value.

    ``decay_steps`` counts from step 0 (warm-up included). None means "the run's length": the
    Learner fills in the engine's ``max_steps``, so ``--config.max_steps=200`` shortens the
    schedule with the run instead of leaving it 10x too long.
    """
    if decay_steps is None:
        raise ValueError("warmup_cosine: decay_steps=None must be filled in by the Learner "
                         "from the run's max_steps")
    return optax.warmup_cosine_decay_schedule(
        init_value=init_value, peak_value=peak_value, warmup_steps=warmup_steps,
        decay_steps=max(decay_steps, warmup_steps + 1), end_value=end_value)


def constant(value: float) -> Schedule:
    return lambda step: jnp.asarray(value, jnp.float32)
