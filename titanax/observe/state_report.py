"""Per-device bytes of the train state under ZeRO / FSDP, for ``Engine.explain`` / ``--explain``.

What a user choosing between replicated state, ZeRO-1/2 and FSDP wants to see before launching:
how many bytes of params, gradients and optimizer state each device holds, and -- for FSDP -- how
much it gathers while the step runs (one layer at a time with ``per_microbatch``, the whole model
with ``per_step``). Computed from the layouts alone (no arrays, no compile).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import jax
import numpy as np
from jax.sharding import PartitionSpec

from titanax.parallel import rules
from titanax.parallel.plan import bytes_text


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def _local_bytes(shape, spec, mesh_shape, itemsize) -> int:
    return int(math.prod(rules.local_shape(tuple(shape), spec, mesh_shape))) * itemsize


def _tree_bytes(parameter_specs, specs, mesh_shape, itemsize) -> int:
    leaves = jax.tree_util.tree_leaves(parameter_specs, is_leaf=rules.is_param_leaf)
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=_is_spec)
    return sum(_local_bytes(p.shape, s, mesh_shape, itemsize) for p, s in zip(leaves, spec_leaves))


def describe(*, parameter_specs: Any, param_specs: Any, grad_specs: Any, opt_state: Any,
             mesh_shape: Mapping[str, int], itemsize: int, title: str,
             axis: Optional[str], dims: Any, gathers: Optional[str],
             trainable: Any = None) -> str:
    """The table: params / gradients / optimizer state per device, and the gathered working set.

    ``opt_state``: the optimizer state as ShapeDtypeStructs with shardings (a restore target);
    ``title``: the strategy's name for the layout; ``dims``: per param, the dimension split over
    ``axis`` (None: whole); ``gathers``: when params are gathered while the step runs
    ("per_step" / "per_microbatch"), None when they are stored whole; ``trainable``: the
    trainable params (train/trainable.py; None: all) -- ``grad_specs`` cover those only."""
    params = _tree_bytes(parameter_specs, param_specs, mesh_shape, itemsize)
    trained_specs = trainable.select(parameter_specs) if trainable is not None else \
        parameter_specs
    grads = _tree_bytes(trained_specs, grad_specs, mesh_shape, itemsize)
    state = 0
    for leaf in jax.tree_util.tree_leaves(opt_state):
        sharded = getattr(leaf, "sharding", None) is not None
        spec = leaf.sharding.spec if sharded else PartitionSpec()
        state += _local_bytes(leaf.shape, spec, mesh_shape, np.dtype(leaf.dtype).itemsize)
    lines = [f"train state per device ({title}):",
             f"  params           {bytes_text(params)}",
             f"  gradients        {bytes_text(grads)} (reduced)",
             f"  optimizer state  {bytes_text(state)}",
             f"  total            {bytes_text(params + grads + state)}"]
    if trainable is not None and not trainable.everything:
        lines += _frozen_lines(parameter_specs, param_specs, trainable, mesh_shape, itemsize,
                               trained_bytes=_tree_bytes(
                                   trained_specs, trainable.select(param_specs), mesh_shape,
                                   itemsize), state_bytes=state)
    if gathers is not None:
        whole, layer = _gathered(parameter_specs, param_specs, dims, mesh_shape, axis, itemsize)
        if gathers == "per_step":
            lines.append(f"  gathered while the step runs: {bytes_text(whole)} (every param, "
                         "gathered once before the microbatch loop)")
        elif not layer["one_layer"]:
            lines.append(f"  gathered while the step runs: {bytes_text(whole)} (no layer stack: "
                         "every param at its use)")
        else:
            unstacked = whole - layer["stacked_total"]
            lines.append(f"  gathered while a layer runs: {bytes_text(layer['one_layer'])} per "
                         f"stacked layer (the layer loop holds about two at a time: "
                         f"{bytes_text(2 * layer['one_layer'])}) + {bytes_text(unstacked)} of "
                         "unstacked params at their use")
    return "\n".join(lines)


def _gathered(parameter_specs, param_specs, dims, mesh_shape, axis, itemsize):
    """Bytes of every sharded param gathered (TP-local), and of one stacked layer's."""
    leaves = jax.tree_util.tree_leaves(parameter_specs, is_leaf=rules.is_param_leaf)
    spec_leaves = jax.tree_util.tree_leaves(param_specs, is_leaf=_is_spec)
    dim_leaves = jax.tree_util.tree_structure(param_specs, is_leaf=_is_spec).flatten_up_to(dims)
    size = mesh_shape[axis]
    whole = stacked_total = one_layer = 0
    for leaf, spec, dim in zip(leaves, spec_leaves, dim_leaves):
        if dim is None:
            continue
        # (Over the axes its spec names on that dimension: ZeRO's, and any also_over.)
        entry = tuple(spec)[dim] if dim < len(tuple(spec)) else None
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        factor = math.prod(mesh_shape[a] for a in axes) if axes else size
        gathered = _local_bytes(leaf.shape, spec, mesh_shape, itemsize) * factor
        whole += gathered
        stacked = getattr(leaf, "stacked_dims", 0)
        if stacked:
            local = rules.local_shape(tuple(leaf.shape), spec, mesh_shape)
            stacked_total += gathered
            one_layer += gathered // int(math.prod(local[:stacked]))
    return whole, {"stacked_total": stacked_total, "one_layer": one_layer}


def one_layer_bytes(parameter_specs: Any, itemsize: int) -> int:
    """Bytes of one layer of every stacked param (global shapes): the unit FSDP's per-layer
    gathers are measured in."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(parameter_specs, is_leaf=rules.is_param_leaf):
        stacked = getattr(leaf, "stacked_dims", 0)
        if stacked:
            total += int(math.prod(leaf.shape[stacked:])) * itemsize
    return total


def _frozen_lines(parameter_specs, param_specs, trainable, mesh_shape, itemsize, *,
                  trained_bytes: int, state_bytes: int):
    """What freezing saves: the trainable share of the params, and the gradient and optimizer
    state the frozen ones would have needed (the state at the trainable ones' bytes per byte)."""
    counts = trainable.count(parameter_specs, lambda spec: int(math.prod(spec.shape)))
    total = counts["trainable"] + counts["frozen"]
    frozen_bytes = _tree_bytes(parameter_specs, param_specs, mesh_shape, itemsize) - trained_bytes
    per_byte = state_bytes / trained_bytes if trained_bytes else 0.0
    return [f"  trainable params {counts['trainable']:,} of {total:,} "
            f"({100.0 * counts['trainable'] / max(total, 1):.2f}%); the frozen "
            f"{bytes_text(frozen_bytes)} per device get no gradient and no optimizer state: "
            f"{bytes_text(frozen_bytes)} of gradients and about "
            f"{bytes_text(int(per_byte * frozen_bytes))} of optimizer state saved per device"]
