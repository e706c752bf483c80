"""Tests of MeshSpec and ProcessGroups on 8 simulated CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from titanax import errors
from titanax.runtime.mesh import MeshSpec, ProcessGroups


def test_shape_inference_and_axis_types():
    mesh = MeshSpec(axes=("data", "model"), shape=(None, 2)).build()
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert dict(MeshSpec(axes=("data",)).build().shape) == {"data": 8}


def test_impossible_shape_names_the_device_count():
    with pytest.raises(errors.MeshError) as info:
        MeshSpec(axes=("data", "model"), shape=(3, None)).build()
    assert "8 devices" in info.value.message and info.value.path == "mesh.shape"
    with pytest.raises(errors.MeshError) as info:
        MeshSpec(axes=("data", "model"), shape=(4, 4)).build()
    assert "needs 16 devices but 8 are available" in info.value.message


def test_config_level_mistakes_are_reported_before_build():
    cfg = MeshSpec.default_config().set(axes=("data", "data"), shape=(None, None, 2))
    with pytest.raises(errors.ConfigValidationError) as info:
        cfg.validate()
    text = str(info.value)
    assert "axes: axis names must be unique" in text
    assert "shape: has 3 entries but there are 2 axes" in text
    assert "at most one entry may be None" in text
    with pytest.raises(errors.MeshError):
        MeshSpec(axes=("data", "model")).build()


def test_explicit_device_ids_and_order():
    spec = MeshSpec(devices=[7, 6, 5, 4], axes=("data", "model"), shape=(2, 2))
    mesh = spec.build()
    assert [d.id for d in mesh.devices.flat] == [4, 5, 6, 7]
    with pytest.raises(errors.MeshError) as info:
        MeshSpec(devices=[0, 99], axes=("data",)).build()
    assert "no device with id 99" in info.value.message
    with pytest.raises(errors.MeshError):
        MeshSpec(devices=[1, 1], axes=("data",)).build()


def test_innermost_axis_holds_consecutive_devices():
    mesh = MeshSpec(axes=("data", "model"), shape=(None, 2)).build()
    assert mesh.devices[0, 0].id + 1 == mesh.devices[0, 1].id


def test_describe_lists_axes_devices_and_processes():
    text = MeshSpec(axes=("data", "model"), shape=(4, 2)).describe()
    lines = text.splitlines()
    assert lines[0] == "mesh data=4 x model=2: 8 cpu device(s) in 1 process(es)"
    assert lines[1].split() == ["data", "model", "device", "process"]
    assert lines[2].split() == ["0", "0", "0", "0"] and lines[-1].split() == ["3", "1", "7", "0"]


def test_process_groups_outside_and_inside_shard_map():
    mesh = MeshSpec(axes=("data", "model"), shape=(4, 2)).build()
    groups = ProcessGroups(mesh)
    assert groups.size("data") == 4 and groups.size("model") == 2
    assert groups.rank("data") == 0 and groups.ranks("data") == (0, 1, 2, 3)
    with pytest.raises(errors.MeshError):
        groups.size("pipe")

    def body(x):
        return x + groups.rank("data") * 10 + groups.rank("model")

    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data", "model"),
                                out_specs=P("data", "model")))(jnp.zeros((4, 2), jnp.int32))
    np.testing.assert_array_equal(np.asarray(out), [[0, 1], [10, 11], [20, 21], [30, 31]])
