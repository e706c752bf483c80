"""Multi-slice meshes: groups of devices with fast links inside (a TPU slice's ICI, a GPU host's
or rack's NVLink), joined by the slower data-center network (DCN).

A mesh axis of size ``n`` spread over ``d`` slices is laid out as ``(d, n / d)``: its outer part
steps from slice to slice, its inner part stays inside one, so only the axes the user spreads
over slices (``MeshSpec.Config.dcn_shape``; data or FSDP replicas, whose one reduction per step
tolerates DCN) ever cross it -- tensor parallelism's every-layer collectives stay on ICI. This is
MaxText's hybrid mesh (``create_hybrid_device_mesh``), written out so that ``--explain`` can say
which of the step's collectives cross slices.

Which slice a device is in: its ``slice_index`` (multi-slice TPU), else its process's place --
the processes split evenly over the slices in process order (a GPU host or, on CPU, a process
standing in for one).
"""

from __future__ import annotations

import math
from typing import Any, List, Sequence, Tuple

import numpy as np

from titanax import errors


def slices_of(devices: Sequence[Any], *, slices: int) -> List[int]:
    """The slice of each of ``devices``: their ``slice_index`` where those name several slices
    (multi-slice TPU; other devices say 0), else their process's place."""
    given = [getattr(d, "slice_index", None) for d in devices]
    if None not in given and len(set(given)) > 1:
        return [int(index) for index in given]
    processes = sorted({d.process_index for d in devices})
    per_slice = max(len(processes) // slices, 1)
    return [processes.index(d.process_index) // per_slice for d in devices]


def has_slice_index(devices: Sequence[Any]) -> bool:
    """Whether the devices name their slices themselves (multi-slice TPU)."""
    return len({getattr(d, "slice_index", None) for d in devices}) > 1


def check_divides(*, dcn_shape: Sequence[int], shape: Sequence[int], process_count: int,
                  has_slice_index: bool) -> None:
    """Each axis a whole number of slices wide, and (without the devices' own slice index)
    every slice a whole number of processes."""
    slices = math.prod(dcn_shape)
    for size, across in zip(shape, dcn_shape):
        if size % across:
            raise errors.MeshError(
                f"an axis of {size} devices cannot be spread over {across} slices "
                f"(dcn_shape {tuple(dcn_shape)}, shape {tuple(shape)})", path="mesh.dcn_shape",
                suggestion="give each axis a number of slices that divides its size")
    if not has_slice_index and process_count % slices:
        raise errors.MeshError(
            f"{slices} slices (dcn_shape {tuple(dcn_shape)}) do not divide the job's "
            f"{process_count} process(es): a slice is a whole number of processes here",
            path="mesh.dcn_shape",
            suggestion=f"make the product of dcn_shape divide {process_count} (e.g. one slice "
                       "per host), or run as many processes as slices")


def arrange(devices: Sequence[Any], *, shape: Tuple[int, ...], dcn_shape: Tuple[int, ...]
            ) -> np.ndarray:
    """``devices`` (in (process, id) order) as the hybrid mesh of ``shape``: axis ``i`` steps
    over ``dcn_shape[i]`` slices outside, ``shape[i] / dcn_shape[i]`` devices of a slice
    inside."""
    slices = math.prod(dcn_shape)
    members = [[] for _ in range(slices)]
    for device, index in zip(devices, slices_of(devices, slices=slices)):
        members[index].append(device)
    per_slice = len(devices) // slices
    if any(len(group) != per_slice for group in members):
        raise errors.MeshError(
            f"the slices hold {[len(g) for g in members]} devices: the mesh needs "
            f"{per_slice} in each", path="mesh.dcn_shape",
            suggestion="give every slice (host) the same number of devices")
    inside = tuple(size // across for size, across in zip(shape, dcn_shape))
    grid = np.empty(tuple(dcn_shape) + inside, dtype=object)
    for index, group in enumerate(members):
        block = np.empty(per_slice, dtype=object)
        block[:] = group
        grid[np.unravel_index(index, dcn_shape)] = block.reshape(inside)
    count = len(shape)
    interleaved = [axis for i in range(count) for axis in (i, count + i)]
    return grid.transpose(interleaved).reshape(shape)


def slice_grid(devices: np.ndarray, *, slices: int) -> np.ndarray:
    """The slice of every device of a mesh's device array."""
    return np.array(slices_of(list(devices.flat), slices=slices)).reshape(devices.shape)


def crosses(grid: np.ndarray, axes: Sequence[int]) -> bool:
    """Whether a collective over mesh ``axes`` (positions) joins devices of different slices."""
    if not axes:
        return False
    rest = [i for i in range(grid.ndim) if i not in axes]
    groups = grid.transpose(rest + list(axes)).reshape(-1, math.prod(grid.shape[i] for i in axes))
    return bool((groups != groups[:, :1]).any())


def slices_along(grid: np.ndarray, axis: int) -> int:
    """How many slices one line of the mesh along ``axis`` steps through."""
    return len(set(np.moveaxis(grid, axis, -1).reshape(-1, grid.shape[axis])[0].tolist()))
