"""MeshSpec: the named grid of devices a run uses, and ProcessGroups: positions along its axes.

A Titanax step runs in ``shard_map`` over every axis of this mesh, so the mesh is the single
statement of how devices are arranged. ``build()`` orders devices by (process, id) before reshaping,
so the innermost (last) axis -- where tensor parallelism, the chattiest axis, belongs -- stays
within one process (one host) whenever its size divides the local device count.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from titanax import errors
from titanax.config import REQUIRED, Configurable, Required
from titanax.parallel import collectives
from titanax.runtime import slices as slices_lib


class MeshSpec(Configurable):
    """A device mesh with named axes; one ``None`` in ``shape`` is inferred from the device count."""

    class Config(Configurable.Config):
        # Which devices: "all" (every device of every process), or a list of devices or device ids.
        # None means "all".
        devices: Union[str, Sequence[Any], None] = "all"
        # Axis names, outermost first, e.g. ("data", "model").
        axes: Required[Tuple[str, ...]] = REQUIRED
        # Size of each axis; at most one None, inferred so the product equals the device count.
        # None for the whole field means: one axis over all devices (only with a single axis).
        shape: Optional[Tuple[Optional[int], ...]] = None
        # Free-form hints for the user's own device ordering (kept in the config and metadata;
        # e.g. {"nvlink_groups": 8}). Titanax itself orders by (process, device id).
        topology: Optional[Dict[str, Any]] = None
        # Multi-slice: how many slices (groups joined by the data-center network, DCN) each
        # axis spans, e.g. (2, 1) for data over 2 slices and model inside each. Axis i is laid
        # out as dcn_shape[i] slices x shape[i] / dcn_shape[i] devices of a slice, so only the
        # axes given more than 1 cross DCN (runtime/slices.py). A device's slice: its
        # slice_index (TPU), else its process's place (processes split evenly over slices).
        # None: one slice.
        dcn_shape: Optional[Tuple[int, ...]] = None

        def _validate_values(self):
            if isinstance(self.axes, tuple):
                if len(set(self.axes)) != len(self.axes):
                    yield "axes", f"axis names must be unique, got {self.axes}"
                if any(not a for a in self.axes):
                    yield "axes", "axis names must be non-empty"
                if self.shape is not None and len(self.shape) != len(self.axes):
                    yield "shape", (f"has {len(self.shape)} entries but there are "
                                    f"{len(self.axes)} axes {self.axes}")
            if self.shape is not None:
                if sum(s is None for s in self.shape) > 1:
                    yield "shape", f"at most one entry may be None (inferred), got {self.shape}"
                if any(s is not None and s < 1 for s in self.shape):
                    yield "shape", f"sizes must be >= 1, got {self.shape}"
            if self.dcn_shape is not None:
                if isinstance(self.axes, tuple) and len(self.dcn_shape) != len(self.axes):
                    yield "dcn_shape", (f"has {len(self.dcn_shape)} entries but there are "
                                        f"{len(self.axes)} axes {self.axes}")
                if any(not isinstance(d, int) or d < 1 for d in self.dcn_shape):
                    yield "dcn_shape", f"slices per axis must be ints >= 1, got {self.dcn_shape}"
            if isinstance(self.devices, str) and self.devices != "all":
                yield "devices", f"must be 'all', None or a list of devices, got {self.devices!r}"

    def devices(self) -> List[jax.Device]:
        """The selected devices, ordered by (process index, device id)."""
        cfg = self.config
        if cfg.devices is None or cfg.devices == "all":
            chosen = list(jax.devices())
        else:
            by_id = {d.id: d for d in jax.devices()}
            chosen = []
            for entry in cfg.devices:
                if isinstance(entry, int):
                    if entry not in by_id:
                        raise errors.MeshError(
                            f"no device with id {entry}", path="mesh.devices",
                            suggestion=f"device ids here: {sorted(by_id)}")
                    chosen.append(by_id[entry])
                else:
                    chosen.append(entry)
            if len({d.id for d in chosen}) != len(chosen):
                raise errors.MeshError("a device is listed twice", path="mesh.devices")
        return sorted(chosen, key=lambda d: (d.process_index, d.id))

    def resolved_shape(self, num_devices: Optional[int] = None) -> Tuple[int, ...]:
        """The axis sizes with the ``None`` entry inferred."""
        cfg = self.config
        count = len(self.devices()) if num_devices is None else num_devices
        if cfg.shape is None:
            if len(cfg.axes) != 1:
                raise errors.MeshError(
                    f"a mesh with axes {cfg.axes} needs a shape", path="mesh.shape",
                    suggestion=f"e.g. shape=({', '.join(['None'] + ['1'] * (len(cfg.axes) - 1))})")
            return (count,)
        known = math.prod(s for s in cfg.shape if s is not None)
        if None in cfg.shape:
            if count % known:
                raise errors.MeshError(
                    f"cannot infer the None axis of shape {cfg.shape}: {count} devices are not "
                    f"divisible by {known}", path="mesh.shape",
                    suggestion=f"choose sizes whose product divides the {count} devices"
                    + _simulate_hint(known, count))
            shape = tuple(count // known if s is None else s for s in cfg.shape)
        else:
            shape = tuple(cfg.shape)
        if math.prod(shape) != count:
            raise errors.MeshError(
                f"shape {shape} needs {math.prod(shape)} devices but {count} are available",
                path="mesh.shape",
                suggestion=f"make the sizes multiply to {count}, or put None in one entry to "
                           "infer it" + _simulate_hint(math.prod(shape), count))
        return shape

    def build(self) -> Mesh:
        """The jax Mesh (every axis of type Auto; Titanax's steps make them manual explicitly);
        with ``dcn_shape``, the slices' hybrid layout."""
        devices = self.devices()
        shape = self.resolved_shape(len(devices))
        dcn_shape = self.config.dcn_shape
        if dcn_shape is not None:
            slices_lib.check_divides(
                dcn_shape=dcn_shape, shape=shape,
                process_count=len({d.process_index for d in devices}),
                has_slice_index=slices_lib.has_slice_index(devices))
            grid = slices_lib.arrange(devices, shape=shape, dcn_shape=tuple(dcn_shape))
        else:
            grid = np.empty(len(devices), dtype=object)
            grid[:] = devices
            grid = grid.reshape(shape)
        return Mesh(grid, tuple(self.config.axes), axis_types=(AxisType.Auto,) * len(shape))

    def slice_count(self) -> int:
        """How many slices the mesh spans (1 without ``dcn_shape``)."""
        return math.prod(self.config.dcn_shape) if self.config.dcn_shape else 1

    def describe(self) -> str:
        """Axes, sizes and, for every device, its coordinates, id and process (and slice)."""
        return describe_mesh(self.build(), slices=self.slice_count())


def describe_mesh(mesh: Mesh, *, slices: int = 1) -> str:
    """A readable summary of a jax Mesh: one line of axes, then one line per device (with its
    slice when the mesh spans ``slices`` > 1)."""
    devices = mesh.devices
    platforms = sorted({d.platform for d in devices.flat})
    processes = sorted({d.process_index for d in devices.flat})
    sizes = " x ".join(f"{name}={size}" for name, size in mesh.shape.items())
    grid = slices_lib.slice_grid(devices, slices=slices) if slices > 1 else None
    across = ""
    if grid is not None:
        spanning = [f"{name}={slices_lib.slices_along(grid, i)}"
                    for i, name in enumerate(mesh.axis_names) if slices_lib.crosses(grid, [i])]
        across = f", {slices} slices (over DCN: {', '.join(spanning) or 'no axis'})"
    lines = [f"mesh {sizes}: {devices.size} {'/'.join(platforms)} device(s) in "
             f"{len(processes)} process(es){across}"]
    header = "  " + "  ".join(f"{name:>6}" for name in mesh.axis_names) + "  device  process"
    lines.append(header + ("  slice" if grid is not None else ""))
    for index in np.ndindex(devices.shape):
        device = devices[index]
        coords = "  ".join(f"{i:>6}" for i in index)
        lines.append(f"  {coords}  {device.id:>6}  {device.process_index:>7}"
                     + (f"  {grid[index]:>5}" if grid is not None else ""))
    return "\n".join(lines)


class ProcessGroups:
    """Sizes of mesh axes, and where this device (or process) sits along each."""

    def __init__(self, mesh: Mesh):
        self._mesh = mesh

    def _check(self, axis: str) -> None:
        if axis not in self._mesh.shape:
            raise errors.MeshError(f"the mesh has no axis {axis!r}", path=f"mesh axis {axis!r}",
                                   suggestion=f"axes: {', '.join(self._mesh.axis_names)}")

    def size(self, axis: str) -> int:
        """Number of devices along ``axis``."""
        self._check(axis)
        return int(self._mesh.shape[axis])

    def rank(self, axis: str) -> Union[int, jax.Array]:
        """Position along ``axis``.

        Inside ``shard_map``: this device's index (a traced value). Outside: the smallest
        position held by this process's devices (a process may hold several; see ``ranks``).
        """
        self._check(axis)
        if collectives.in_manual_context():
            return collectives.axis_index(axis)
        return min(self.ranks(axis))

    def ranks(self, axis: str) -> Tuple[int, ...]:
        """Every position along ``axis`` where this process holds a device."""
        self._check(axis)
        dimension = self._mesh.axis_names.index(axis)
        me = jax.process_index()
        return tuple(sorted({index[dimension] for index in np.ndindex(self._mesh.devices.shape)
                             if self._mesh.devices[index].process_index == me}))


def _simulate_hint(needed: int, available: int) -> str:
    """On a CPU-only machine, how to simulate the devices a mesh needs."""
    if needed <= available or jax.default_backend() != "cpu":
        return ""
    return (f"; on a CPU-only machine, simulate them: --cpu_devices={needed} (launcher) or "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={needed} before jax starts")
