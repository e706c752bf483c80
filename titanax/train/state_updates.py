"""State updates: new values that layers write for params the optimizer does not train.

A layer that keeps a statistic -- a running mean, a batch-norm variance, a step counter -- stores
it as a param and writes its next value with ``add_state_update(name, value)`` during a training
forward. The gradient computer collects those values (``collect``), averages them over its
microbatches, the reducer averages them over the data axis in the step's one data-axis
all-reduce, and the step writes them over the optimizer's result for that param (``write``).

Averaging is what the one-device run does when the statistic is a mean over the batch: with
microbatches and data shards of equal size, the mean of each shard's ``m * old + (1 - m) * mean``
is ``m * old + (1 - m) * mean of the whole batch``. Every device ends the step with the same value,
so a param replicated over the data axis stays replicated.

A layer may write an *increment* instead (``add_state_update(name, step, increment=True)``): it
is added here to the param as stored -- float32 master params under mixed precision -- rather
than to the compute-dtype copy the layer read, whose rounding would swallow a small step.

A state update must name a param: the same path (``<module>/<child>/.../<name>``) and the same
local shape. Anything else is refused with the path, never dropped or attached somewhere new.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

import jax
import jax.numpy as jnp

from titanax import errors
from titanax.modules.context import StateIncrement, flat_state_updates
from titanax.modules.gather_on_use import is_gather_on_use
from titanax.parallel.sharding import path_string
from titanax.utils.dtypes import at_least_float32


def collect(state_updates: Mapping[str, Any], params: Any, *, where: str,
            stored: Any = None) -> Dict[int, jax.Array]:
    """``{position among the flattened params: new value}`` from an OutputCollection's nested
    ``state_updates``, each checked against the (local-view) param it replaces. ``stored``: the
    params as stored (before the cast to the compute dtype), which an increment is added to."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    by_path = {path_string(path): (index, leaf) for index, (path, leaf) in enumerate(flat)}
    stored_leaves = (jax.tree_util.tree_leaves(stored, is_leaf=is_gather_on_use)
                     if stored is not None else None)
    out: Dict[int, jax.Array] = {}
    for path, value in flat_state_updates(state_updates):
        increment = isinstance(value, StateIncrement)
        if increment:
            value = value.value
        if path not in by_path:
            raise errors.ModuleError(
                f"a state update was written for {path!r}, which is not a param of the model",
                path=where, suggestion="declare the state as a ParameterSpec of the layer that "
                "updates it and write add_state_update(<its name>, value) once per call (a "
                "second call of the same child writes under '<child>_1')")
        index, param = by_path[path]
        value = jnp.asarray(value)
        if value.shape != param.shape:
            raise errors.ModuleError(
                f"the state update for {path!r} has shape {value.shape}, the param's local "
                f"shape is {param.shape}", path=where,
                suggestion="write a value of the param's own (local, per-device) shape; under "
                "FSDP (ZeRO stage 3) a param a layer updates must be stored whole: "
                f"--config.plan.zero.dim_overrides=\"{{'{path}': None}}\"")
        value = at_least_float32(value)
        if increment:
            base = stored_leaves[index] if stored_leaves is not None else None
            if base is None or is_gather_on_use(base):
                raise errors.ModuleError(
                    f"the increment of {path!r} has no whole stored value to be added to",
                    path=where, suggestion="store the param whole (under FSDP: "
                    f"--config.plan.zero.dim_overrides=\"{{'{path}': None}}\")")
            value = at_least_float32(base) + value
        out[index] = value
    return out


def write(params: Any, updates: Mapping[int, jax.Array]) -> Any:
    """``params`` with the leaves at the flattened positions in ``updates`` replaced (cast to
    their dtype)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    for index, value in updates.items():
        leaves[index] = value.astype(leaves[index].dtype)
    return jax.tree_util.tree_unflatten(treedef, leaves)
