"""The layout pipeline: where every param and its optimizer state live, worked out once.

One pure function, ``build_layout(transforms, mesh_shape=..., parameter_specs=...)``, folds the
plan's transforms (``Plan.layout_transforms``) over the model's parameter specs, in this order:

0. ``logical_axes.LogicalAxisRules`` -- params that name logical axes (a Flax model's
   partitioning metadata) get the mesh axes the plan's ``logical_axis_rules`` give them: the TP
   axis as their declared layout, the ZeRO / FSDP axis as the dimension the state split takes;
1. ``rules.LayerLayouts`` -- the layouts layers declare, overridden by the TP rules;
2. ``pipeline.StageSplit`` -- the pipe axis on the stacked-layer dimension (PP);
3. ``interleaved_stack.CircularView`` -- the stack held as ``[v, S, L/(vS), ...]`` (circular PP);
4. ``state_dims.StateSplit`` -- the ZeRO / FSDP axis on one real dimension of each param;
5. (context and expert parallelism add none: params stay whole over the context axis, and MoE
   layers declare the expert axis on their experts, set from the plan like the TP axis);
6. ``DropUnitAxes`` -- mesh axes of size 1 leave every spec: nothing moves over them.

The result is a frozen ``Layout``. The step builder, the state manager, the checkpointer and
``--explain`` all read it; none of them recomputes a part of it. Each transform is a small frozen
object with a ``name`` (shown by ``--explain``) and ``apply(layout) -> layout``: a parallel kind
that moves params adds one, and nothing else changes (see docs/concepts.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Protocol, Sequence, Tuple

import jax
from jax.sharding import PartitionSpec

from titanax.parallel import rules
from titanax.parallel.batch_layout import BatchLayout


class LayoutTransform(Protocol):
    """One step of the layout pipeline."""

    # Shown by --explain, in order ("TP rules", "PP stages", ...).
    name: str

    def apply(self, layout: "Layout") -> "Layout":
        """The layout after this transform (pure: the input is not changed)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every param's global shape and split, and where its optimizer state lives."""

    # Mesh axis sizes, in mesh order.
    mesh_axes: Tuple[Tuple[str, int], ...]
    # The params' ParameterSpecs (or ShapeDtypeStructs for a hand-written step's params) with
    # the global shapes the train state holds: under the circular schedule the stack's view.
    parameter_specs: Any
    # One PartitionSpec per param: how the train state's params are split over the mesh.
    param_specs: Any = None
    # The specs after the layer layouts and TP rules only: what the layers run with (the axes
    # later transforms add are gathered on use, sliced by a schedule, or hold state only), so
    # what a layer checks it can implement.
    layer_specs: Any = None
    # Per param, the dimension the plan's logical axis rules put the ZeRO / FSDP axis on (None:
    # they ask for none; parallel/logical_axes.py); None: no rules.
    logical_state_dims: Any = None
    # ZeRO / FSDP: the mesh axis the optimizer state (FSDP: the params too) is split over.
    state_axis: Optional[str] = None
    # Per param, the dimension that carries ``state_axis`` (None: kept whole); None: no ZeRO.
    state_dims: Any = None
    # Per param, the mesh axes that dimension is split over -- ``state_axis`` and the ZeRO
    # config's ``also_over`` axes its layout leaves free (None: kept whole); None: the ZeRO
    # axis alone for every param.
    state_axes: Any = None
    # FSDP: the params themselves carry ``state_axis`` (``param_specs`` name it); else only the
    # optimizer state does.
    params_sharded: bool = False
    # The circular schedule's view of the layer stack (None: the canonical layout).
    stack_view: Optional[Any] = None
    # The transforms that made this layout, in order.
    history: Tuple[str, ...] = ()
    # Which mesh axis holds each logical dimension of the model's params and activations
    # (parallel/axis_binding.py): what layers ask while they run in the step.
    axis_binding: Any = None
    # Where the batch's rows and sequence live, and what that asks of the reduction
    # (parallel/batch_layout.py).
    batch: BatchLayout = BatchLayout()

    @property
    def mesh_shape(self) -> Mapping[str, int]:
        return dict(self.mesh_axes)

    def evolve(self, transform: str, **changes: Any) -> "Layout":
        """A copy with ``changes``, recording ``transform`` in the history."""
        return dataclasses.replace(self, history=self.history + (transform,), **changes)

    @property
    def canonical_param_specs(self) -> Any:
        """The param specs of the layout checkpoints hold (the stack's canonical ``[L, ...]``)."""
        if self.stack_view is None:
            return self.param_specs
        return self.stack_view.canonical_partition_specs(self.param_specs)

    def as_view(self, params: Any) -> Any:
        """Canonical params (arrays or ShapeDtypeStructs) in this layout's shapes."""
        return params if self.stack_view is None else self.stack_view.view(params)

    def local_shapes(self, dtype_of: Any) -> Any:
        """The params' per-device ShapeDtypeStructs (``dtype_of(global dtype) -> dtype``)."""
        mesh_shape = self.mesh_shape
        return jax.tree_util.tree_map(
            lambda s, spec: jax.ShapeDtypeStruct(rules.local_shape(s.shape, spec, mesh_shape),
                                                 dtype_of(s.dtype)),
            self.parameter_specs, self.param_specs, is_leaf=rules.is_param_leaf)


def build_layout(transforms: Sequence[LayoutTransform], *, mesh_shape: Mapping[str, int],
                 parameter_specs: Any, axis_binding: Any = None) -> Layout:
    """The layout of ``parameter_specs`` after every transform, in order."""
    layout = Layout(mesh_axes=tuple((a, int(s)) for a, s in mesh_shape.items()),
                    parameter_specs=parameter_specs, axis_binding=axis_binding)
    for transform in transforms:
        layout = transform.apply(layout)
    return layout


def map_specs(fn: Any, specs: Any) -> Any:
    """``fn`` over every PartitionSpec leaf of ``specs``."""
    return jax.tree_util.tree_map(fn, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def without_axes(spec: PartitionSpec, dropped: Sequence[str]) -> PartitionSpec:
    """``spec`` with the mesh axes ``dropped`` removed from every entry."""
    entries = []
    for entry in spec:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        kept = tuple(a for a in axes if a not in dropped)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def unit_axes(mesh_shape: Mapping[str, int]) -> Tuple[str, ...]:
    """The mesh axes of size 1."""
    return tuple(a for a, size in mesh_shape.items() if int(size) == 1)


@dataclasses.dataclass(frozen=True)
class DropUnitAxes:
    """The last transform: a mesh axis of size 1 splits nothing, so it leaves every spec.

    Then no value in the step is ever typed as varying over it, and no collective runs over it
    (a TP model on ``data=8 x model=1`` compiles to exactly the data-parallel step)."""

    name: str = "size-1 axes dropped"

    def apply(self, layout: Layout) -> Layout:
        dropped = unit_axes(layout.mesh_shape)
        if not dropped:
            return layout
        specs = map_specs(lambda spec: without_axes(spec, dropped), layout.param_specs)
        return layout.evolve(self.name, param_specs=specs, batch=layout.batch.without(dropped))
