"""Optimizer and schedule factories for ``config_for_function`` (AdamW, Lion, SGD, Muon;
warmup+cosine).

They differ from the optax factories they wrap in one way: weight decay is *scaled per param* by
``ParameterSpec.weight_decay_scale`` (0 for biases and norms), supplied by the learner as a tree.
Every transformation here but Muon's is elementwise, so it is correct in local view on sharded
params; Muon's gathers what it needs whole from the params' layouts (``muon.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import optax

from titanax import errors
from titanax.config import checked_by
from titanax.config import value_checks as check
from titanax.train import muon as muon_lib

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


# The dtypes Adam's moments may be stored in (float16's range cannot hold a small gradient's
# square: the second moment flushes to zero).
MOMENT_DTYPES = ("float32", "bfloat16")
# The largest b2 for bfloat16 moments: the second moment settles within 2^-8 / (1 - b2) of
# g^2 -- 8% at 0.95 (DeepSeek-V3's), 39% at 0.99, never at 0.999.
BFLOAT16_MAX_B2 = 0.96


def _adam_arguments(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, moments_dtype=None, *,
                    prefix="", **_):
    yield from check.fraction(prefix + "b1", b1)
    yield from check.fraction(prefix + "b2", b2)
    yield from check.positive(prefix + "eps", eps)  # eps = 0 divides a zero gradient by zero.
    yield from check.at_least(prefix + "weight_decay", weight_decay, 0)
    if moments_dtype is not None and moments_dtype not in MOMENT_DTYPES:
        yield "moments_dtype", (f"must be one of {', '.join(MOMENT_DTYPES)} (or None: the "
                                f"params' dtype), got {moments_dtype!r}")
    if moments_dtype == "bfloat16" and b2 > BFLOAT16_MAX_B2:
        yield "b2", (f"{b2} with bfloat16 moments: a second moment of 8 significant bits "
                     f"stops falling where its step (1 - b2) x (v - g^2) is under half its "
                     f"spacing, so it would stay far above g^2 (0.999: it never falls); use "
                     f"b2 <= {BFLOAT16_MAX_B2} (DeepSeek-V3: 0.95) or float32 moments")


def scale_by_adam_stored_in(dtype: str, *, b1: float, b2: float,
                            eps: float) -> optax.GradientTransformation:
    """Adam's scaling with both moments stored in ``dtype`` and computed in float32 (DeepSeek-V3
    keeps AdamW's moments in bfloat16: 4 bytes per param instead of 8). The state is optax's
    ``ScaleByAdamState``, so a checkpoint's structure is Adam's."""
    stored = jnp.dtype(dtype)

    def init(params):
        zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, stored), params)
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros,
                                      nu=jax.tree_util.tree_map(jnp.copy, zeros))

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        wide = lambda x: x.astype(jnp.float32)  # noqa: E731
        mu = jax.tree_util.tree_map(lambda g, m: b1 * wide(m) + (1 - b1) * wide(g),
                                    updates, state.mu)
        nu = jax.tree_util.tree_map(lambda g, v: b2 * wide(v) + (1 - b2) * jnp.square(wide(g)),
                                    updates, state.nu)
        first, second = 1 - b1 ** wide(count), 1 - b2 ** wide(count)
        scaled = jax.tree_util.tree_map(
            lambda g, m, v: (m / first / (jnp.sqrt(v / second) + eps)).astype(g.dtype),
            updates, mu, nu)
        narrow = lambda tree: jax.tree_util.tree_map(lambda x: x.astype(stored), tree)  # noqa
        return scaled, optax.ScaleByAdamState(count=count, mu=narrow(mu), nu=narrow(nu))

    return optax.GradientTransformation(init, update)


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
          weight_decay: float = 0.0, moments_dtype: Optional[str] = None, *,
          decay_scales: Any = None) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay, scaled per param). ``moments_dtype``: the dtype both
    moments are stored in ("bfloat16": half the optimizer state, computed in float32); None:
    the params' dtype, as optax's."""
    scaling = optax.scale_by_adam(b1=b1, b2=b2, eps=eps) if moments_dtype is None else \
        scale_by_adam_stored_in(moments_dtype, b1=b1, b2=b2, eps=eps)
    return optax.chain(scaling,
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


def _muon_arguments(beta=0.95, ns_steps=5, eps=1e-8, weight_decay=0.0, consistent_rms=None,
                    adam_b1=0.9, adam_b2=0.999, adam_eps=1e-8, adam_weight_decay=0.0,
                    matrices=muon_lib.DEFAULT_MATRICES, not_matrices=muon_lib.DEFAULT_NOT_MATRICES,
                    **_):
    yield from check.fraction("beta", beta)
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
        yield "ns_steps", f"must be an int >= 1 (Newton-Schulz iterations), got {ns_steps!r}"
    yield from check.positive("eps", eps)
    yield from check.at_least("weight_decay", weight_decay, 0)
    yield from check.positive("consistent_rms", consistent_rms)
    yield from _adam_arguments(b1=adam_b1, b2=adam_b2, eps=adam_eps,
                               weight_decay=adam_weight_decay, prefix="adam_")
    yield from check.regexes("matrices", matrices)
    yield from check.regexes("not_matrices", not_matrices)


@checked_by(_muon_arguments)
def muon(learning_rate: ScalarOrSchedule, beta: float = 0.95, ns_steps: int = 5,
         eps: float = 1e-8, nesterov: bool = True, weight_decay: float = 0.0,
         consistent_rms: Optional[float] = None,
         adam_learning_rate: Optional[ScalarOrSchedule] = None, adam_b1: float = 0.9,
         adam_b2: float = 0.999, adam_eps: float = 1e-8, adam_weight_decay: float = 0.0,
         matrices: Sequence[str] = muon_lib.DEFAULT_MATRICES,
         not_matrices: Sequence[str] = muon_lib.DEFAULT_NOT_MATRICES, *,
         decay_scales: Any = None, param_layouts: Any = None) -> optax.GradientTransformation:
    """Muon on the weight matrices (params whose path matches ``matrices`` and not
    ``not_matrices``, whose layer names fan-in and fan-out dimensions), AdamW on the rest --
    with Nesterov momentum, as ``optax.contrib.muon`` (``adam_learning_rate`` None: the same
    schedule). ``ns_steps``: Newton-Schulz iterations; ``consistent_rms``: scale each matrix's
    update to this RMS (Moonshot's rule) instead of ``sqrt(max(1, fan_out / fan_in))``.
    ``param_layouts``: the params' layouts (the Learner passes them; muon.py)."""
    if param_layouts is None:
        raise errors.ConfigError(
            "Muon needs each param's layout (which dims are a matrix, how they are split): "
            "the Learner passes it", path="optimizer",
            suggestion="set it as learner.optimizer, not as the engine's optimizer")
    labels = muon_lib.matrix_labels(param_layouts, matrices=matrices, not_matrices=not_matrices)

    def masked(tree: Any, label: str) -> Any:
        return None if tree is None else muon_lib.masked(tree, labels, keep=label)

    orthogonalized = muon_lib.scale_by_muon(
        masked(param_layouts, "muon"), beta=beta, steps=ns_steps, eps=eps, nesterov=nesterov,
        consistent_rms=consistent_rms)
    adam_rate = learning_rate if adam_learning_rate is None else adam_learning_rate
    return optax.partition({
        "muon": optax.chain(orthogonalized,
                            decayed_weights(weight_decay, masked(decay_scales, "muon")),
                            optax.scale_by_learning_rate(learning_rate)),
        "adam": optax.chain(optax.scale_by_adam(b1=adam_b1, b2=adam_b2, eps=adam_eps,
                                                nesterov=nesterov),
                            decayed_weights(adam_weight_decay, masked(decay_scales, "adam")),
                            optax.scale_by_learning_rate(adam_rate)),
    }, labels)


def _describe_muon(*, param_layouts: Any, matrices: Sequence[str] = muon_lib.DEFAULT_MATRICES,
                   not_matrices: Sequence[str] = muon_lib.DEFAULT_NOT_MATRICES,
                   **fields: Any) -> str:
    labels = muon_lib.matrix_labels(param_layouts, matrices=matrices, not_matrices=not_matrices)
    return muon_lib.describe(param_layouts=param_layouts, labels=labels, **fields)


# (--explain's lines: the Learner calls a factory's describe with its config's fields.)
muon.describe = _describe_muon


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
