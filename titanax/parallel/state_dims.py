"""Which real dimension of each param carries the ZeRO / FSDP axis.

ZeRO-1/2 split the optimizer state, and FSDP (ZeRO-3) the params themselves, over one mesh axis
(the data axis, or an axis of its own under HSDP). The axis goes on one *real* dimension of the
param, added to the spec the earlier transforms (layer layout, TP rules, pipeline) produced, so a
global array means the same thing on every mesh and strategy, and a checkpoint restores
anywhere. (A flattened, padded chunk per device would mean other numbers on another mesh.)

The dimension is chosen per param, on the host, once:

1. a path override (``ZeRO.Config.dim_overrides``, first match wins; ``None`` keeps it whole);
2. state a layer writes itself (``ParameterSpec.layer_state``: running statistics) and params
   with fewer than ``min_shard_size`` elements stay whole (norm scales, biases: the bytes saved
   would not pay for the collectives);
3. the dimension the plan's logical axis rules put the axis on (``preferred``: a Flax model's
   ``("embed", "mlp")`` names, parallel/logical_axes.py), when it can carry it;
4. otherwise the largest dimension that is not split already, not a stacked-layer dimension
   (``ParameterSpec.stacked_dims``: the layer scan slices those), not kept whole by the logical
   axis rules, and divisible by the axis size; the first such on ties. None fits: the param
   stays whole (``describe`` shows it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence, Tuple

import jax
from jax.sharding import PartitionSpec

from titanax import errors
from titanax.parallel import rules, sharding


def choose_dims_and_axes(parameter_specs: Any, param_specs: Any, *, axis: str, axis_size: int,
                         min_shard_size: int,
                         dim_overrides: Sequence[Tuple[str, Optional[int]]] = (),
                         preferred: Any = None,
                         also_over: Sequence[Tuple[str, int]] = ()) -> Tuple[Any, Any]:
    """``(dims, axes)``: per param, the dimension (>= 0) the split goes on, or None (kept whole),
    and the mesh axes it is split over -- ``axis``, then each of ``also_over`` ((mesh axis,
    size) pairs) the param's layout leaves free; where no dimension divides by all of them,
    ``axis`` alone (the split FSDP gives without ``also_over``). ``preferred``: a tree like the
    params of what the logical axis rules ask for (``logical_axes.StatePreference``: a
    dimension, taken where it can carry the axis, and the dimensions they keep whole; None where
    the param names no axes)."""
    with_all = _choose(parameter_specs, param_specs, axis=axis, axis_size=axis_size,
                       min_shard_size=min_shard_size, dim_overrides=dim_overrides,
                       preferred=preferred, also_over=also_over)
    if not also_over:
        return with_all, None
    alone = _choose(parameter_specs, param_specs, axis=axis, axis_size=axis_size,
                    min_shard_size=min_shard_size, dim_overrides=dim_overrides,
                    preferred=preferred, also_over=())

    def pick(partition, dim_all, dim_alone):
        if dim_all is not None:
            taken = rules.spec_axes(partition)
            return dim_all, (axis,) + tuple(a for a, _ in also_over if a not in taken)
        return dim_alone, None if dim_alone is None else (axis,)

    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    picked = jax.tree_util.tree_map(pick, param_specs, with_all, alone, is_leaf=is_spec)
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and not is_spec(x)  # noqa: E731
    first = jax.tree_util.tree_map(lambda p: p[0], picked, is_leaf=is_pair)
    second = jax.tree_util.tree_map(lambda p: p[1], picked, is_leaf=is_pair)
    return first, second


def _choose(parameter_specs, param_specs, *, axis, axis_size, min_shard_size, dim_overrides,
            preferred, also_over):
    """``choose_dims_and_axes``'s dimensions with the size of ``axis`` x each of ``also_over`` a
    param's layout leaves free."""
    compiled = [(pattern, rules.compile_pattern(pattern), dim) for pattern, dim in dim_overrides]
    if preferred is None:
        preferred = jax.tree_util.tree_map(lambda _: None, param_specs,
                                           is_leaf=lambda x: isinstance(x, PartitionSpec))

    def choose(path, spec, partition, preference):
        path = sharding.path_string(path)
        shape = tuple(spec.shape)
        entries = tuple(partition) + (None,) * (len(shape) - len(partition))
        taken = rules.spec_axes(partition)
        size = axis_size * math.prod(n for a, n in also_over if a not in taken)
        if axis in taken:
            raise errors.PlanError(
                f"param {path} is already split over mesh axis {axis!r} (spec {partition}); "
                "ZeRO/FSDP adds that axis itself", path="plan.zero.axis",
                suggestion=f"drop mesh axis {axis!r} from the param's layout (TP rules or the "
                           "layer's declaration): ZeRO adds it where it fits")
        stacked = getattr(spec, "stacked_dims", 0)  # (Hand-written steps' shapes have none.)
        for pattern, regex, dim in compiled:
            if regex.fullmatch(path):
                return _checked_override(path, pattern, dim, shape, entries, axis, size,
                                         stacked)
        if getattr(spec, "layer_state", False) or math.prod(shape) < min_shard_size:
            return None
        whole = preference.whole if preference is not None else ()
        fits = [dim for dim in range(stacked, len(shape))
                if entries[dim] is None and shape[dim] % size == 0
                and shape[dim] >= size and dim not in whole]
        if preference is not None and preference.dim in fits:
            return preference.dim
        best = None
        for dim in fits:
            if best is None or shape[dim] > shape[best]:
                best = dim
        return best

    return jax.tree_util.tree_map_with_path(
        choose, parameter_specs, param_specs, preferred, is_leaf=rules.is_param_leaf)


def _checked_override(path, pattern, dim, shape, entries, axis, axis_size, stacked):
    if dim is None:
        return None
    where = "plan.zero.dim_overrides"
    resolved = dim + len(shape) if dim < 0 else dim
    problem = None
    if not 0 <= resolved < len(shape):
        problem = f"dimension {dim} does not exist (shape {shape})"
    elif resolved < stacked:
        problem = f"dimension {dim} stacks the layers (the layer scan slices it)"
    elif entries[resolved] is not None:
        problem = f"dimension {dim} is already split over {entries[resolved]!r}"
    elif shape[resolved] % axis_size:
        problem = (f"dimension {dim} has size {shape[resolved]}, not divisible by mesh axis "
                   f"{axis!r} of size {axis_size}")
    if problem:
        raise errors.PlanError(f"override {pattern!r} for param {path}: {problem}", path=where,
                               suggestion="pick another dimension, or None to keep it whole")
    return resolved


def add_axis(param_specs: Any, dims: Any, axis: str, axes: Any = None) -> Any:
    """``param_specs`` with ``axis`` on each param's chosen dimension (``dims`` from
    ``choose_dims_and_axes``; None leaves the spec as it is) -- or, with ``axes`` (from the same
    call), each param's own axes there."""
    def add(partition: PartitionSpec, dim: Optional[int], own=None) -> PartitionSpec:
        if dim is None:
            return partition
        entries = list(tuple(partition))
        entries += [None] * (dim + 1 - len(entries))
        entries[dim] = axis if own is None or len(own) == 1 else tuple(own)
        return PartitionSpec(*entries)

    if axes is None:
        return jax.tree_util.tree_map(add, param_specs, dims,
                                      is_leaf=lambda x: isinstance(x, PartitionSpec))
    return jax.tree_util.tree_map(add, param_specs, dims, axes,
                                  is_leaf=lambda x: isinstance(x, PartitionSpec))


@dataclasses.dataclass(frozen=True)
class StateSplit:
    """The ZeRO / FSDP transform of the layout pipeline (parallel/layout.py): the dimension of
    every param that carries ``axis``, and -- FSDP -- the axis added to the params' specs."""

    axis: str
    # Stage 3: the params themselves are split (else only the optimizer state).
    params_sharded: bool
    min_shard_size: int
    dim_overrides: Tuple[Tuple[str, Optional[int]], ...] = ()
    # More mesh axes the params are split over where their layout does not split them
    # (``ZeRO.Config.also_over``).
    also_over: Tuple[str, ...] = ()
    name: str = "ZeRO / FSDP state split"

    def apply(self, layout):
        size = int(layout.mesh_shape[self.axis])
        also_over = tuple((a, int(layout.mesh_shape[a])) for a in self.also_over)
        if size * math.prod(n for _, n in also_over) == 1:  # Nothing to split over.
            dims = jax.tree_util.tree_map(lambda _: None, layout.param_specs,
                                          is_leaf=lambda x: isinstance(x, PartitionSpec))
            axes = None
        else:
            dims, axes = choose_dims_and_axes(
                layout.parameter_specs, layout.param_specs, axis=self.axis, axis_size=size,
                min_shard_size=self.min_shard_size, dim_overrides=self.dim_overrides,
                preferred=layout.logical_state_dims, also_over=also_over)
        specs = add_axis(layout.param_specs, dims, self.axis, axes) if self.params_sharded \
            else layout.param_specs
        return layout.evolve(self.name, param_specs=specs, state_axis=self.axis,
                             state_dims=dims, state_axes=axes,
                             params_sharded=self.params_sharded)
