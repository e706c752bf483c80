"""Logical axis names -> mesh axes: the first transform of the layout pipeline.

A Flax model names the dimensions of its params (``nnx.with_partitioning(init, ("embed",
"mlp"))``, ``nn.with_logical_partitioning``), as MaxText and AXLearn do, and leaves the mesh to a
table of rules. Here the table is the plan's ``logical_axis_rules`` -- ``{logical name: mesh axis
or None}`` -- and what a rule asks for depends on the role of its axis:

- the ZeRO / FSDP axis: the dimension the state split puts that axis on (``StateSplit`` takes
  it where it can carry it: divisible, not a stacked-layer dimension). Without ZeRO the rule
  asks for nothing: the params are whole on every data shard.
- the TP axis: the param's declared layout (the layer then runs on its shard, which only a module
  that calls the collectives itself can do: the Flax adapters refuse it otherwise). Such rules
  are also part of the plan's axis binding (``Plan.axis_binding``), which a Titanax layer's
  logical dimensions resolve through. Only a *named rule* splits an adapted Flax param: the
  binding also puts Titanax's own dimensions (heads, mlp, vocab) on the TP axis, which a Flax
  module that does not call the collectives could not run on.
- None: the dimension stays whole -- under ZeRO too. So does a named dimension without a rule:
  with rules, only what they map is split (a dimension with no name is ZeRO's to choose).

Any other axis (pipe, context, expert, the data axis under HSDP) cannot split a param's
dimension here and is refused, as is an axis the mesh lacks, and a rule that maps a name no param
uses to an axis (a misspelling would otherwise leave the model unsplit without a word).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Dict, Optional, Tuple

import jax

from titanax import errors
from titanax.parallel import rules

WHERE = "plan.logical_axis_rules"


@dataclasses.dataclass(frozen=True)
class StatePreference:
    """What the rules ask of one param's ZeRO / FSDP split (``state_dims.choose_dims_and_axes``)."""

    # The dimension a rule maps to the ZeRO / FSDP axis (None: none does).
    dim: Optional[int]
    # Named dimensions the rules keep whole (mapped to None, or with no rule).
    whole: Tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class LogicalAxisRules:
    """The transform (parallel/layout.py): params' logical names mapped by the plan's rules."""

    # (logical name, mesh axis or None) pairs.
    rules: Tuple[Tuple[str, Optional[str]], ...]
    # The plan's TP axis (None: no tensor parallelism).
    tp_axis: Optional[str] = None
    # The ZeRO / FSDP axis (None: no ZeRO).
    state_axis: Optional[str] = None
    # {mesh axis: role} of every axis the plan uses (for the refusals).
    roles: Tuple[Tuple[str, str], ...] = ()
    name: str = "logical axis rules"

    def apply(self, layout):
        if not self.rules:
            return layout
        table = dict(self.rules)
        used = _names_in_use(layout.parameter_specs)
        self._check(table, used, layout.mesh_shape)
        preferences = {}

        def resolve(path, spec):
            names = getattr(spec, "logical_axes", None)
            if names is None:
                return spec
            mesh_axes = list(spec.mesh_axes or (None,) * len(spec.shape))
            wanted, whole = None, []
            for dim, logical in enumerate(names):
                axis = table.get(logical) if logical is not None else None
                if axis is not None and axis == self.tp_axis:
                    mesh_axes[dim] = axis
                elif axis is not None and axis == self.state_axis:
                    wanted = dim if wanted is None else wanted
                elif logical is not None:
                    whole.append(dim)
            preferences[jax.tree_util.keystr(path)] = StatePreference(wanted, tuple(whole))
            return dataclasses.replace(spec, mesh_axes=tuple(mesh_axes))

        specs = jax.tree_util.tree_map_with_path(resolve, layout.parameter_specs,
                                                 is_leaf=rules.is_param_leaf)
        dims = jax.tree_util.tree_map_with_path(
            lambda path, _: preferences.get(jax.tree_util.keystr(path)), layout.parameter_specs,
            is_leaf=rules.is_param_leaf)
        return layout.evolve(self.name, parameter_specs=specs, logical_state_dims=dims)

    def _check(self, table: Dict[str, Optional[str]], used: Dict[str, str],
               mesh_shape) -> None:
        roles = dict(self.roles)
        for logical, axis in table.items():
            where = f"{WHERE}[{logical!r}]"
            if logical not in used and axis is not None:
                close = difflib.get_close_matches(logical, list(used), n=2, cutoff=0.5)
                hint = (f"did you mean {' or '.join(repr(c) for c in close)}? " if close else "")
                raise errors.PlanError(
                    f"no param of the model names the logical axis {logical!r}" + (
                        f" (the params name: {', '.join(sorted(used))})" if used else
                        " (no param of this model names any logical axis)"),
                    path=where, suggestion=hint + "fix the name, or drop the rule")
            if axis is None:
                continue
            if axis not in mesh_shape:
                raise errors.PlanError(
                    f"logical axis {logical!r} maps to mesh axis {axis!r}, which the mesh does "
                    "not have", path=where,
                    suggestion=f"mesh axes: {', '.join(mesh_shape)}; or map it to None (whole)")
            hsdp_data = roles.get(axis) == "data_parallel" and self.state_axis is not None
            if axis not in (self.tp_axis, self.state_axis) and (
                    roles.get(axis) not in ("data_parallel", None) or hsdp_data):
                serves = ("data_parallel, whose devices hold copies of the state under HSDP"
                          if hsdp_data else roles[axis])
                raise errors.PlanError(
                    f"logical axis {logical!r} maps to mesh axis {axis!r}, which serves "
                    f"{serves}: a param's dimension is split over the tensor-parallel axis or "
                    "the ZeRO / FSDP axis only", path=where,
                    suggestion="map it to the ZeRO / FSDP axis "
                               + (f"({self.state_axis!r})" if self.state_axis else "(plan.zero)")
                               + ", the TP axis, or None")


def _names_in_use(parameter_specs: Any) -> Dict[str, str]:
    """``{logical name: a param path that uses it}``."""
    used: Dict[str, str] = {}
    for path, spec in jax.tree_util.tree_flatten_with_path(
            parameter_specs, is_leaf=rules.is_param_leaf)[0]:
        for name in getattr(spec, "logical_axes", None) or ():
            if name is not None:
                used.setdefault(name, jax.tree_util.keystr(path))
    return used
