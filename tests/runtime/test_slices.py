"""Multi-slice meshes: the hybrid arrangement (each axis's slices outside, a slice's devices
inside), which collectives cross slices, and the refusals -- on stand-in devices (the layout is
arithmetic on their process and id; tests/test_multi_process.py runs two slices for real)."""

import dataclasses

import numpy as np
import pytest

from titanax import errors
from titanax.runtime import slices


@dataclasses.dataclass(frozen=True)
class Device:
    id: int
    process_index: int
    slice_index: int = 0


def _hosts(processes, per_process, **extra):
    return [Device(id=p * 100 + i, process_index=p, **extra)
            for p in range(processes) for i in range(per_process)]


def _processes(grid):
    return np.vectorize(lambda d: d.process_index)(grid)


def test_only_the_axes_given_slices_cross_them():
    # model outermost in the mesh, but data is the axis spread over the 2 slices (hosts): each
    # model pair stays in a host; without dcn_shape a plain reshape puts model across them.
    grid = slices.arrange(_hosts(2, 4), shape=(2, 4), dcn_shape=(1, 2))
    processes = _processes(grid)
    np.testing.assert_array_equal(processes, [[0, 0, 1, 1], [0, 0, 1, 1]])
    ids = slices.slice_grid(grid, slices=2)
    assert slices.crosses(ids, [1]) and not slices.crosses(ids, [0])
    assert slices.crosses(ids, [0, 1]) and not slices.crosses(ids, [])
    assert slices.slices_along(ids, 1) == 2 and slices.slices_along(ids, 0) == 1
    plain = np.array(_hosts(2, 4), dtype=object).reshape(2, 4)
    assert slices.crosses(slices.slice_grid(plain, slices=2), [0])


def test_two_axes_over_four_slices_keep_each_slices_block_whole():
    # Both axes over 2 slices each: slice (i, j) is the block [2i:2i+2, j] (its 2 devices along
    # the first axis's inner part).
    grid = slices.arrange(_hosts(4, 2), shape=(4, 2), dcn_shape=(2, 2))
    np.testing.assert_array_equal(_processes(grid), [[0, 1], [0, 1], [2, 3], [2, 3]])
    ids = slices.slice_grid(grid, slices=4)
    assert slices.crosses(ids, [0]) and slices.crosses(ids, [1])
    assert sorted(d.id for d in grid.flat) == sorted(d.id for d in _hosts(4, 2))


def test_devices_that_name_their_slice_are_grouped_by_it():
    # (Multi-slice TPU: one process may not be one slice; slice_index decides.)
    devices = [Device(id=i, process_index=i // 2, slice_index=i % 2) for i in range(8)]
    assert slices.has_slice_index(devices)
    grid = slices.arrange(devices, shape=(2, 4), dcn_shape=(2, 1))
    np.testing.assert_array_equal(np.vectorize(lambda d: d.slice_index)(grid),
                                  [[0, 0, 0, 0], [1, 1, 1, 1]])


@pytest.mark.parametrize("dcn_shape,shape,processes,says", [
    ((3, 1), (6, 2), 2, "do not divide the job's 2 process(es)"),
    ((1, 4), (4, 2), 4, "an axis of 2 devices cannot be spread over 4 slices"),
])
def test_shapes_that_do_not_divide_are_refused_by_name(dcn_shape, shape, processes, says):
    with pytest.raises(errors.MeshError) as raised:
        slices.check_divides(dcn_shape=dcn_shape, shape=shape, process_count=processes,
                             has_slice_index=False)
    assert raised.value.path == "mesh.dcn_shape" and says in raised.value.message
