"""The seed-002 acceptance list for apply_named_sharding and shard_batch_specs, and helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from titanax import errors
from titanax.parallel import sharding
from titanax.parallel.plan import TP
from titanax.runtime.mesh import MeshSpec

MESH = MeshSpec(axes=("data", "model"), shape=(None, 2)).build()


def test_apply_named_sharding_places_leaves_and_preserves_shape_and_dtype():
    tree = {"w": jnp.arange(16, dtype=jnp.float32).reshape(4, 4),
            "b": np.ones((4,), np.int32), "scale": jnp.float32(2.0)}
    specs = {"w": P("model", None), "b": P(), "scale": P()}
    placed = sharding.apply_named_sharding(tree, MESH, specs)
    for key in tree:
        leaf = placed[key]
        assert isinstance(leaf, jax.Array)
        assert leaf.shape == np.shape(tree[key]) and leaf.dtype == jnp.asarray(tree[key]).dtype
        assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.spec == specs[key]
    np.testing.assert_array_equal(np.asarray(placed["w"]), np.asarray(tree["w"]))
    assert placed["w"].addressable_shards[0].data.shape == (2, 4)


def test_structure_mismatch_raises_with_suggestion():
    with pytest.raises(errors.ShardingError) as info:
        sharding.apply_named_sharding({"a": jnp.ones(2), "b": jnp.ones(2)}, MESH, {"a": P()})
    assert info.value.path == "<root>"
    assert "structure mismatch between value tree and spec tree" in info.value.message
    assert "build_param_specs" in info.value.suggestion


def test_non_array_leaves_pass_through_and_shape_dtype_structs_get_shardings():
    tree = {"n": 3, "name": "x", "s": jax.ShapeDtypeStruct((8, 2), jnp.bfloat16)}
    placed = sharding.apply_named_sharding(tree, MESH, {"n": P(), "name": P(),
                                                        "s": P("data", None)})
    assert placed["n"] == 3 and placed["name"] == "x"
    assert isinstance(placed["s"], jax.ShapeDtypeStruct)
    assert placed["s"].sharding == NamedSharding(MESH, P("data", None))


def test_placement_errors_name_the_leaf_path():
    with pytest.raises(errors.ShardingError) as info:
        sharding.apply_named_sharding({"layer": {"w": jnp.ones((4, 4))}}, MESH,
                                      {"layer": {"w": P("pipe", None)}})
    assert info.value.path == "layer/w" and "'pipe'" in info.value.message
    with pytest.raises(errors.ShardingError) as info:
        sharding.apply_named_sharding({"w": jnp.ones((3,))}, MESH, {"w": P("model")})
    assert "not divisible" in info.value.message


def test_single_device_mesh():
    mesh = MeshSpec(devices=[0], axes=("data",)).build()
    placed = sharding.apply_named_sharding({"x": jnp.ones((4, 2))}, mesh, {"x": P("data")})
    assert placed["x"].sharding.spec == P("data")


def test_shard_batch_specs_defaults():
    batch = {"images": jnp.zeros((8, 4)), "labels": jnp.zeros((8,)), "meta": 1,
             "scalar": jnp.float32(0), "shape_only": jax.ShapeDtypeStruct((8, 2, 3), jnp.int32)}
    specs = sharding.shard_batch_specs(batch, "data")
    assert specs == {"images": P("data", None), "labels": P("data"), "meta": P(),
                     "scalar": P(), "shape_only": P("data", None, None)}
    assert sharding.shard_batch_specs(batch, None)["images"] == P()
    placed = sharding.apply_named_sharding(
        {k: batch[k] for k in ("images", "labels")}, MESH,
        {k: specs[k] for k in ("images", "labels")})
    assert placed["images"].addressable_shards[0].data.shape == (2, 4)


def test_tree_paths_and_spec_for():
    tree = {"a": {"b": [jnp.ones(1), jnp.ones(2)]}}
    assert sharding.tree_paths(tree) == {"a": {"b": ["a/b/0", "a/b/1"]}}
    rules = {"**/qkv/weight": (None, "model"), "**": ()}
    assert sharding.spec_for("x/qkv/weight", (4, 6), rules, MESH) == P(None, "model")
    assert sharding.spec_for("x/ln/scale", (4,), rules, MESH) == P()
    assert TP(rules=rules).spec_for("x/qkv/weight", (4, 6), MESH) == P(None, "model")
    with pytest.raises(errors.ShardingError):
        sharding.spec_for("x", (4,), {"y": ()}, MESH)
