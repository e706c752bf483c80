"""Hand-written train steps (the seed's ``@step_fn`` UX), run in local view by the engine.

The user writes the gradient computation *and* its collective::

    @tx.step_fn
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        grads = tx.collectives.pmean(grads, axis="data")
        return state.apply_gradients(grads=grads), {"loss": loss}

The engine hands the step its params cast to *varying* over every mesh axis, so ``jax.grad``
returns local gradients (no hidden all-reduce), and keeps the replicated originals for
``apply_gradients``. If the new params still differ across an axis they are replicated on, the
step never reduced its gradients there: that is rejected at compile time, naming the axis.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import jax

from titanax import errors
from titanax.parallel import collectives, rules
from titanax.train.metric_reduction import reduce_metrics
from titanax.train.precision import Precision
from titanax.train.train_state import TrainState

_STEP_ATTR = "_titanax_step_fn"


def step_fn(fn: Callable) -> Callable:
    """Marks a hand-written step ``(state, batch) -> (state, metrics)`` for ``Engine.fit``.

    The engine applies the precision policy to the batch, runs the step in local view inside
    ``shard_map``, checks that the collectives it uses name mesh axes of the plan and that it
    reduced its gradients, and averages the metrics it returns over the devices.
    """
    setattr(fn, _STEP_ATTR, True)
    return fn


def _check_reduced(params: Any, param_specs: Any, data_axis: Optional[str]) -> None:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    specs = treedef.flatten_up_to(param_specs)
    for (path, leaf), spec in zip(leaves, specs):
        stray = sorted(collectives.varying_axes(leaf) - set(rules.spec_axes(spec)))
        if stray:
            axis = data_axis if data_axis in stray else stray[0]
            where = jax.tree_util.keystr(path) or "<root>"
            raise errors.StepError(
                f"the step's new params at {where} differ across mesh axis {axis!r}, over which "
                "they are replicated: the gradients were never reduced over it",
                path=f"mesh axis {axis!r}",
                suggestion=f"reduce the gradients before applying them, e.g. "
                           f"grads = tx.collectives.pmean(grads, axis={axis!r})")


_STEP_RETURNS = "return (state.apply_gradients(grads=grads), {'loss': loss})"


def _kind(value: Any) -> str:
    if isinstance(value, jax.Array):
        return "jax.Array"
    return type(value).__qualname__


def _describe(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(_kind(v) for v in value)})"
    kind = _kind(value)
    return f"an {kind}" if kind[0] in "AEIOUaeiou" else f"a {kind}"


def _unpack_step_output(fn: Callable, out: Any) -> Tuple[TrainState, Dict[str, jax.Array]]:
    """``(new_state, metrics)`` from what a hand-written step returned, or a StepError."""
    where = getattr(fn, "__qualname__", "step")
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], TrainState)):
        raise errors.StepError(
            f"the step returned {_describe(out)}; a train step returns (new_state, metrics)",
            path=where, suggestion=_STEP_RETURNS)
    new_state, metrics = out
    if not isinstance(metrics, dict):
        raise errors.StepError(
            f"the step's metrics are {_describe(metrics)}, not a dict of scalars", path=where,
            suggestion=_STEP_RETURNS)
    check_scalar_metrics(metrics, where=where)
    return new_state, metrics


def check_scalar_metrics(metrics: Dict[str, Any], *, where: str) -> None:
    """Every metric must be one number: a vector would be logged as its first element only."""
    for name, value in metrics.items():
        shape = getattr(value, "shape", ())
        if tuple(shape) != ():
            raise errors.StepError(
                f"metric {name!r} has shape {tuple(shape)}; metrics must be scalars",
                path=f"{where}: metrics[{name!r}]",
                suggestion="reduce it in the step (e.g. jnp.mean or jnp.sum), or log it "
                           "elsewhere")


def wrap_user_step(fn: Callable, *, axes: Sequence[str], data_axis: Optional[str],
                   param_specs: Any, precision: Precision, eval_only: bool = False) -> Callable:
    """The local function the engine runs in shard_map for a hand-written step."""
    axes = tuple(axes)
    if eval_only:
        def local_eval(params, batch):
            state = TrainState(params=params, opt_state=None, step=None, rngs={})
            out = fn(state, precision.cast_for_compute(batch))
            metrics = out[1] if isinstance(out, tuple) else out
            if not isinstance(metrics, dict):
                raise errors.StepError(
                    f"the eval step returned {_describe(out)}; it returns a dict of scalar "
                    "metrics (or (state, metrics))", path=getattr(fn, "__qualname__", "step"),
                    suggestion="return {'loss': loss}")
            check_scalar_metrics(metrics, where=getattr(fn, "__qualname__", "step"))
            return reduce_metrics(metrics, batch_axes=(), axes=axes)
        return local_eval

    def local(state: TrainState, batch: Any) -> Tuple[TrainState, Dict[str, jax.Array]]:
        working = state.replace(params=collectives.cast_varying(state.params, axes),
                                reference_params=state.params)
        new_state, metrics = _unpack_step_output(fn, fn(working, precision.cast_for_compute(batch)))
        _check_reduced(new_state.params, param_specs, data_axis)
        return new_state.replace(reference_params=None), reduce_metrics(metrics, batch_axes=(), axes=axes)

    return local


class UserStep:
    """A hand-written ``@step_fn`` behind the engine's local-step protocol (see
    ``step.ModelStep``): its metrics are reduced to replicated scalars."""

    def __init__(self, fn: Callable, *, axes: Sequence[str], data_axis: Optional[str],
                 param_specs: Any, precision: Precision):
        self.fn = fn
        self._args = dict(axes=axes, data_axis=data_axis, param_specs=param_specs,
                          precision=precision)

    @property
    def metric_spec(self):
        return jax.sharding.PartitionSpec()

    @property
    def train(self) -> Callable:
        return wrap_user_step(self.fn, **self._args)

    @property
    def eval(self) -> Callable:
        return wrap_user_step(self.fn, eval_only=True, **self._args)
