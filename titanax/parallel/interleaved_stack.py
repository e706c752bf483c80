"""The circular schedule's view of a layer stack: ``[L, ...]`` held as ``[v, S, L/(vS), ...]``.

With ``v`` virtual stages, pipe device ``s`` runs the model's stages ``r S + s`` (``r < v``): its
layers are not one contiguous block of ``[L, ...]``, so no sharding of the canonical array puts
them on it. The train state therefore keeps every param under the stack (and its optimizer
moments) as the view ``[v, S, L/(vS), ...]`` with the pipe axis on dimension 1; reshaping it back
is the canonical ``[L, ...]`` in layer order (row-major: ``layer = (r S + s) L/(vS) + k``).
Checkpoints are written and read in the canonical layout -- a circular run's checkpoint restores
without a pipeline, with another schedule or onto another number of stages, and the other way
round -- and the shapes differ visibly, so a view is never mistaken for the canonical array.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec
from optax.transforms._masking import MaskedNode

from titanax import errors
from titanax.parallel import pipeline, rules
from titanax.parallel.sharding import path_string


class InterleavedStack:
    """Converts param-like trees between the canonical layout and the circular schedule's view."""

    def __init__(self, *, stacked_layers: str, num_layers: int, num_stages: int,
                 virtual_stages: int, pipe_axis: str):
        """``num_layers`` must split into ``num_stages * virtual_stages`` (``CircularView``
        checks it first, naming the config field)."""
        self.prefix = stacked_layers.strip("/") + "/"
        self.num_stages = num_stages
        self.virtual_stages = virtual_stages
        self.layers_per_slice = num_layers // (num_stages * virtual_stages)
        self.pipe_axis = pipe_axis

    def is_stacked(self, path: str) -> bool:
        return path.startswith(self.prefix)

    # --- One leaf --------------------------------------------------------------------------------

    def view_shape(self, shape) -> tuple:
        return (self.virtual_stages, self.num_stages, self.layers_per_slice) + tuple(shape[1:])

    @staticmethod
    def canonical_shape(shape) -> tuple:
        return (shape[0] * shape[1] * shape[2],) + tuple(shape[3:])

    def view_spec(self, spec: PartitionSpec) -> PartitionSpec:
        """``P(pipe, *rest)`` of the canonical layout -> ``P(None, pipe, None, *rest)``."""
        return PartitionSpec(None, self.pipe_axis, None, *tuple(spec)[1:])

    @staticmethod
    def canonical_spec(spec: PartitionSpec) -> PartitionSpec:
        entries = tuple(spec) + (None,) * max(0, 3 - len(spec))
        return PartitionSpec(entries[1], *entries[3:])

    # --- Trees -----------------------------------------------------------------------------------

    def _map(self, fn: Callable[[Any], Any], tree: Any, *, is_leaf=None) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda path, leaf: fn(leaf) if self.is_stacked(path_string(path)) else leaf,
            tree, is_leaf=is_leaf)

    def view(self, params: Any) -> Any:
        """Canonical arrays (or ShapeDtypeStructs) -> views, under ``jit`` or eagerly."""
        return self._map(lambda x: x.reshape(self.view_shape(x.shape)), params)

    def canonical(self, params: Any) -> Any:
        return self._map(lambda x: x.reshape(self.canonical_shape(x.shape)), params)

    def view_parameter_specs(self, parameter_specs: Any) -> Any:
        """The model's ParameterSpecs with the stacked leaves' shapes viewed (init, fan axes and
        the rest keep describing the canonical param, which is what initialisation runs on)."""
        return self._map(lambda s: dataclasses.replace(s, shape=self.view_shape(s.shape),
                                                       stacked_dims=s.stacked_dims + 2),
                         parameter_specs, is_leaf=rules.is_param_leaf)

    def view_partition_specs(self, specs: Any) -> Any:
        return self._map(self.view_spec, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))

    def canonical_partition_specs(self, specs: Any) -> Any:
        return self._map(self.canonical_spec, specs,
                         is_leaf=lambda x: isinstance(x, PartitionSpec))

    def map_optimizer_state(self, tx: optax.GradientTransformation, opt_state: Any,
                            param_paths: Any, fn: Callable[[Any], Any]) -> Any:
        """``fn`` applied to the optimizer-state leaves that mirror a stacked param."""
        # (A part of ``optax.partition``'s state -- Muon's -- holds MaskedNode for the params of
        # the other parts: left as it is.)
        return optax.tree_map_params(
            tx, lambda leaf, path: leaf if isinstance(leaf, MaskedNode) or
            not self.is_stacked(path) else fn(leaf), opt_state,
            param_paths, transform_non_params=lambda x: x,
            is_leaf=lambda x: isinstance(x, (PartitionSpec, jax.ShapeDtypeStruct, MaskedNode)))

    def canonical_struct(self, s: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        """A view's restore target (ShapeDtypeStruct with a NamedSharding) made canonical."""
        sharding = s.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, self.canonical_spec(sharding.spec))
        return jax.ShapeDtypeStruct(self.canonical_shape(s.shape), s.dtype, sharding=sharding)

    def canonical_targets(self, params: Any) -> Any:
        return self._map(self.canonical_struct, params)


@dataclasses.dataclass(frozen=True)
class CircularView:
    """The circular schedule's transform of the layout pipeline (parallel/layout.py): the
    stacked layers' params (shapes and specs) held as the view ``[v, S, L/(vS), ...]``."""

    stacked_layers: str
    pipe_axis: str
    virtual_stages: int
    name: str = "PP circular view"

    def apply(self, layout):
        num_layers = pipeline.stacked_layer_count(layout.parameter_specs,
                                                  self.stacked_layers.strip("/") + "/")
        num_stages = int(layout.mesh_shape[self.pipe_axis])
        if num_layers % (num_stages * self.virtual_stages):
            raise errors.PlanError(
                f"{num_layers} layers do not split into {num_stages} stages x "
                f"{self.virtual_stages} virtual stages",
                path="plan.pipeline_parallel.virtual_stages",
                suggestion=f"use a number of layers divisible by "
                           f"{num_stages * self.virtual_stages}, or fewer virtual stages")
        view = InterleavedStack(stacked_layers=self.stacked_layers, num_layers=num_layers,
                                num_stages=num_stages, virtual_stages=self.virtual_stages,
                                pipe_axis=self.pipe_axis)
        return layout.evolve(self.name, stack_view=view,
                             parameter_specs=view.view_parameter_specs(layout.parameter_specs),
                             param_specs=view.view_partition_specs(layout.param_specs))
