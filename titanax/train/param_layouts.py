"""What an optimizer may know of each trainable param besides its value: its path, its global
shape, its fan dimensions and how the update's local view splits it. Elementwise optimizers need
none of it; Muon (``muon.py``) needs whole matrices, so it reads which dimensions are a matrix
and which mesh axes to gather them over."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Tuple

import jax
from jax.sharding import PartitionSpec

from titanax.parallel import rules
from titanax.parallel.tree_paths import path_string


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """One trainable param, as the optimizer sees it."""

    # The param's path ("decoder/layer/attn/q_weight").
    path: str
    # Its global shape.
    shape: Tuple[int, ...]
    # Its fan-in and fan-out dimensions (ParameterSpec.fan_axes, a fused projection's groups
    # left out of the fan-out; empty: the layer names none).
    fan_in: Tuple[int, ...]
    fan_out: Tuple[int, ...]
    # Per dimension, the mesh axes the update's local view splits it over.
    split: Tuple[Tuple[str, ...], ...]
    # The whole mesh: every axis and its size, in order.
    mesh: Tuple[Tuple[str, int], ...] = ()

    @property
    def parts(self) -> Tuple[int, ...]:
        """Per dimension, into how many parts the local view splits it."""
        sizes = dict(self.mesh)
        return tuple(math.prod(sizes[a] for a in axes) for axes in self.split)

    @property
    def is_matrix(self) -> bool:
        """Whether its layer names both fan-in and fan-out dimensions."""
        return bool(self.fan_in) and bool(self.fan_out)


def _axes(entry: Any) -> Tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def param_layouts(*, parameter_specs: Any, update_specs: Any, mesh_shape: Mapping[str, int],
                  stack_view: Any = None) -> Any:
    """A ParamLayout per param of ``parameter_specs`` (ParameterSpecs of the trainable params)
    with ``update_specs`` (their PartitionSpecs where the optimizer update runs) over a mesh of
    ``mesh_shape``. ``stack_view``: the circular pipeline's view of the stacked layers
    (parallel/interleaved_stack.py), whose specs' fan axes still describe the canonical
    param."""
    def layout(key_path, spec, partition: PartitionSpec) -> ParamLayout:
        path, shape = path_string(key_path), tuple(spec.shape)
        entries = tuple(partition) + (None,) * (len(shape) - len(tuple(partition)))
        fan = spec.fan_axes
        if fan is None or not fan.declared:
            fan_in, fan_out = (), ()
        else:
            offset = (len(shape) - len(stack_view.canonical_shape(shape))
                      if stack_view is not None and stack_view.is_stacked(path) else 0)
            fan = fan.shifted(offset)
            fan_in, fan_out = fan.in_axes, tuple(a for a in fan.out_axes if a not in fan.groups)
        return ParamLayout(path=path, shape=shape, fan_in=fan_in, fan_out=fan_out,
                           split=tuple(_axes(e) for e in entries),
                           mesh=tuple((name, int(size)) for name, size in mesh_shape.items()))

    return jax.tree_util.tree_map_with_path(layout, parameter_specs, update_specs,
                                            is_leaf=rules.is_param_leaf)
