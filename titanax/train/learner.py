"""The learner: turns reduced gradients into a param update.

It wraps any optax ``GradientTransformation`` (the seed's ``OptimizerAdapter``), adds what a
sharded run needs and optax cannot know: weight decay scaled per param from each
``ParameterSpec.weight_decay_scale`` and gradient clipping by the *global* norm (squares summed
over the devices a param is split over, never twice over devices that hold copies). Which part of
the optimizer state a device updates is the state-sharding strategy's (``state_sharding.py``).

Everything here runs in local view inside the engine's ``shard_map``.
"""

from __future__ import annotations

import inspect
from typing import Any, List, Optional, Tuple

import jax
import jax.numpy as jnp
import optax

from titanax import errors
from titanax.config import Configurable, InstantiableConfig, config_for_function
from titanax.parallel import rules
from titanax.train import optimizers


class OptimizerAdapter:
    """Any optax GradientTransformation behind one small interface."""

    def __init__(self, tx: optax.GradientTransformation, *, description: Optional[str] = None):
        self.tx = tx
        # What --explain says of the optimizer (None: nothing beyond the state's size).
        self.description = description

    def init(self, params: Any) -> Any:
        return self.tx.init(params)

    def update(self, grads: Any, opt_state: Any, params: Any = None) -> Tuple[Any, Any]:
        return self.tx.update(grads, opt_state, params)


class Learner(Configurable):
    """Optimizer + clipping + per-param weight decay (on whatever part of the state the
    state-sharding strategy hands it)."""

    class Config(Configurable.Config):
        # An optax factory config; titanax.train.optimizers' factories also take per-param decay
        # scales. learning_rate may itself be a schedule config (e.g. optimizers.warmup_cosine).
        optimizer: InstantiableConfig = config_for_function(optimizers.adamw).set(
            learning_rate=1e-3)
        # Clip gradients to this global L2 norm; None: no clipping.
        max_grad_norm: Optional[float] = None

        def _validate_values(self):
            if self.max_grad_norm is not None and self.max_grad_norm <= 0:
                yield "max_grad_norm", "must be > 0 (or None to disable clipping)"
            yield from _learning_rate_problems(self.optimizer)

    def __init__(self, cfg=None, *, total_steps: Optional[int] = None, **fields):
        """``total_steps``: the run's length; fills a schedule's ``decay_steps=None``."""
        super().__init__(cfg, **fields)
        self._optimizer_cfg = _with_run_length(self.config.optimizer, total_steps)

    def build(self, decay_scales: Any, *, param_layouts: Any = None,
              device_count: int = 1) -> OptimizerAdapter:
        """The optax transformation, with ``decay_scales`` and ``param_layouts``
        (param_layouts.py: what Muon needs of each param) when the factory accepts them; its
        --explain lines from the factory's own ``describe`` (Muon's), if it has one."""
        optimizer_cfg = self._optimizer_cfg
        target = getattr(optimizer_cfg, "fn", None)
        accepted = inspect.signature(target).parameters if target is not None else {}
        extra = {name: value for name, value in (("decay_scales", decay_scales),
                                                 ("param_layouts", param_layouts))
                 if name in accepted}
        tx = optimizer_cfg.instantiate(**extra)
        describe = getattr(target, "describe", None)
        description = None
        if describe is not None and param_layouts is not None:
            fields = {k: getattr(optimizer_cfg, k) for k in optimizer_cfg.keys()}
            description = describe(**{**fields, "param_layouts": param_layouts,
                                      "device_count": device_count})
        return OptimizerAdapter(tx, description=description)

    def apply_update(self, *, adapter: OptimizerAdapter, grads: Any, norm: jax.Array,
                     opt_state: Any, params: Any) -> Tuple[Any, Any]:
        """``(new params, new optimizer state)``: gradients clipped to ``max_grad_norm`` by their
        global ``norm``, then the optax update, added in each param's dtype. Runs on whatever
        part of the params and state the state-sharding strategy hands it."""
        clipped = clip_by_norm(grads, norm, self.config.max_grad_norm)
        updates, new_state = adapter.update(clipped, opt_state, params)
        new_params = jax.tree_util.tree_map(lambda p, u: (p + u).astype(p.dtype), params,
                                            updates)
        return new_params, new_state

    def learning_rate(self, step: jax.Array) -> jax.Array:
        """The learning rate at ``step`` (for logging); NaN when the optimizer has no such field."""
        value = getattr(self._optimizer_cfg, "learning_rate", None)
        if isinstance(value, InstantiableConfig):
            return jnp.asarray(value.instantiate()(step), jnp.float32)
        if isinstance(value, (int, float)):
            return jnp.asarray(value, jnp.float32)
        return jnp.asarray(jnp.nan, jnp.float32)


# Schedule fields that hold a learning rate, and must be positive (end values may be 0).
_POSITIVE_RATE_FIELDS = ("peak_value", "value")


def _rate_fields(optimizer_cfg: Any) -> List[str]:
    """The optimizer's learning-rate fields: ``learning_rate`` and any ``*_learning_rate`` (a
    second part's own, as Muon's ``adam_learning_rate``)."""
    return [name for name in optimizer_cfg.keys()
            if name == "learning_rate" or name.endswith("_learning_rate")]


def _learning_rate_problems(optimizer_cfg: Any):
    """A learning rate <= 0 trains into garbage without any error: refuse it up front (every
    learning-rate field of the optimizer)."""
    for field in _rate_fields(optimizer_cfg):
        yield from _rate_problems(f"optimizer.{field}", getattr(optimizer_cfg, field))


def _rate_problems(where: str, value: Any):
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
        yield where, f"must be > 0, got {value}"
    if isinstance(value, InstantiableConfig):
        for name in _POSITIVE_RATE_FIELDS:
            rate = getattr(value, name, None) if name in value.keys() else None
            if isinstance(rate, (int, float)) and rate <= 0:
                yield f"{where}.{name}", f"must be > 0, got {rate}"
        end = getattr(value, "end_value", None) if "end_value" in value.keys() else None
        if isinstance(end, (int, float)) and end < 0:
            yield f"{where}.end_value", f"must be >= 0, got {end}"
        steps = getattr(value, "decay_steps", None) if "decay_steps" in value.keys() else None
        if isinstance(steps, int) and steps < 1:
            yield f"{where}.decay_steps", \
                f"must be >= 1 (or None: the run's max_steps), got {steps}"


def _with_run_length(optimizer_cfg: Any, total_steps: Optional[int]) -> Any:
    """The optimizer config with every learning-rate schedule's ``decay_steps=None`` set to
    ``total_steps``."""
    filled = None
    for field in _rate_fields(optimizer_cfg):
        schedule = getattr(optimizer_cfg, field)
        if not (isinstance(schedule, InstantiableConfig) and "decay_steps" in schedule.keys()
                and schedule.decay_steps is None):
            continue
        if total_steps is None:
            raise errors.ConfigError(
                "decay_steps=None means the run's length, but max_steps is not set",
                path=f"learner.optimizer.{field}.decay_steps",
                suggestion="set max_steps (or --config.max_steps=N), or give decay_steps "
                           "explicitly")
        filled = filled if filled is not None else optimizer_cfg.clone()
        getattr(filled, field).decay_steps = int(total_steps)
        warmup = (getattr(schedule, "warmup_steps", None) if "warmup_steps" in schedule.keys()
                  else None)
        if isinstance(warmup, int) and warmup >= total_steps:
            print(f"titanax: warning: learner.optimizer.{field}.warmup_steps={warmup} is not "
                  f"below max_steps={total_steps}: the learning rate never reaches its peak; "
                  f"lower it with --config.learner.optimizer.{field}.warmup_steps=N", flush=True)
    return filled if filled is not None else optimizer_cfg


def decay_scales_from_specs(parameter_specs: Any) -> Any:
    """``weight_decay_scale`` of every ParameterSpec (1.0 for leaves that are not specs)."""
    return jax.tree_util.tree_map(lambda s: float(getattr(s, "weight_decay_scale", 1.0)),
                                  parameter_specs, is_leaf=rules.is_param_leaf)


def clip_by_norm(tree: Any, norm: jax.Array, max_norm: Optional[float]) -> Any:
    if max_norm is None:
        return tree
    factor = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-12))
    return jax.tree_util.tree_map(lambda g: g * factor.astype(g.dtype), tree)
