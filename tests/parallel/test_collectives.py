"""Every typed collective against a numpy reference, and every error path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from titanax import errors
from titanax.parallel import collectives as C
from titanax.runtime.mesh import MeshSpec
from tests.numerics import assert_close

MESH = MeshSpec(axes=("data", "model"), shape=(4, 2)).build()
# Global array of shape [4 * 2, 3] laid out so that device (d, m) holds row block d*2+m.
X = np.arange(8 * 3, dtype=np.float32).reshape(8, 3) ** 1.5


def _run(fn, x=X, out_specs=P(("data", "model"))):
    return np.asarray(jax.jit(jax.shard_map(fn, mesh=MESH, in_specs=P(("data", "model")),
                                            out_specs=out_specs))(x))


def _blocks(x=X):
    """[data, model, rows-per-device, 3] view of the per-device blocks."""
    return x.reshape(4, 2, 1, 3)


def test_psum_and_pmean_over_one_and_two_axes():
    blocks = _blocks()
    got = _run(lambda x: C.psum(x, "model")).reshape(4, 2, 1, 3)
    np.testing.assert_allclose(got, np.broadcast_to(blocks.sum(1, keepdims=True), blocks.shape))
    got = _run(lambda x: C.pmean(x, ("data", "model"))).reshape(4, 2, 1, 3)
    # A mean of eight: summed in another order than numpy's.
    assert_close(got, np.broadcast_to(blocks.mean((0, 1), keepdims=True), blocks.shape))


def test_pmax_pmin():
    blocks = _blocks()
    got = _run(lambda x: C.pmax(x, "data")).reshape(4, 2, 1, 3)
    np.testing.assert_allclose(got, np.broadcast_to(blocks.max(0, keepdims=True), blocks.shape))
    got = _run(lambda x: C.pmin(x, "data")).reshape(4, 2, 1, 3)
    np.testing.assert_allclose(got, np.broadcast_to(blocks.min(0, keepdims=True), blocks.shape))


def test_psum_of_a_tree():
    def body(x):
        out = C.psum({"a": x, "b": (x * 2,)}, "model")
        return out["a"] + out["b"][0]
    blocks = _blocks()
    got = _run(body).reshape(4, 2, 1, 3)
    np.testing.assert_allclose(got, np.broadcast_to(3 * blocks.sum(1, keepdims=True),
                                                    blocks.shape))


def test_all_gather_tiled_and_stacked():
    blocks = _blocks()
    got = _run(lambda x: C.all_gather(x, "model", axis_index=0)[None],
               out_specs=P(("data", "model")))
    # Each device gets both model blocks of its data row, concatenated on dim 0.
    expected = np.concatenate([blocks[:, 0], blocks[:, 1]], axis=1)  # [4, 2, 3]
    np.testing.assert_allclose(got.reshape(4, 2, 2, 3), np.stack([expected, expected], 1))
    got = _run(lambda x: C.all_gather(x, "data")[None], out_specs=P(("data", "model")))
    assert got.shape == (8, 4, 1, 3)
    np.testing.assert_allclose(got.reshape(4, 2, 4, 1, 3)[2, 1], blocks[:, 1])


def test_reduce_scatter_add_and_mean():
    x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    blocks = x.reshape(4, 2, 1, 4)

    def body(v):
        return C.reduce_scatter(v, "model", scatter_dimension=1)
    got = _run(body, x).reshape(4, 2, 1, 2)
    summed = blocks.sum(1)  # [4, 1, 4]
    np.testing.assert_allclose(got[:, 0], summed[:, :, :2])
    np.testing.assert_allclose(got[:, 1], summed[:, :, 2:])
    got = _run(lambda v: C.reduce_scatter(v, "model", "mean", scatter_dimension=1), x)
    np.testing.assert_allclose(got.reshape(4, 2, 1, 2)[:, 1], summed[:, :, 2:] / 2)


def test_broadcast_from_a_source_index_including_bools():
    blocks = _blocks()
    got = _run(lambda x: C.broadcast(x, "data", src_index=2)).reshape(4, 2, 1, 3)
    np.testing.assert_allclose(got, np.broadcast_to(blocks[2:3], blocks.shape))
    flags = _run(lambda x: C.broadcast(x > 30, "data", src_index=3).astype(jnp.float32))
    np.testing.assert_array_equal(flags.reshape(4, 2, 1, 3),
                                  np.broadcast_to(blocks[3:4] > 30, blocks.shape))


def test_ppermute_and_shift():
    blocks = _blocks()
    got = _run(lambda x: C.shift(x, "data", 1)).reshape(4, 2, 1, 3)
    np.testing.assert_allclose(got, np.roll(blocks, 1, axis=0))
    got = _run(lambda x: C.ppermute(x, "model", [(0, 1)])).reshape(4, 2, 1, 3)
    np.testing.assert_allclose(got[:, 1], blocks[:, 0])
    np.testing.assert_allclose(got[:, 0], 0)


def test_axis_index_and_size():
    got = _run(lambda x: jnp.zeros_like(x) + C.axis_index("data") * C.axis_size("model")
               + C.axis_index("model"))
    np.testing.assert_array_equal(got[:, 0], np.arange(8))


def test_all_to_all():
    x = np.arange(8 * 2, dtype=np.float32).reshape(8, 2)
    got = _run(lambda v: C.all_to_all(v, "model", split_dimension=1, concat_dimension=0), x)
    blocks = x.reshape(4, 2, 1, 2)
    # Device m receives column m of both model blocks, stacked on dim 0.
    np.testing.assert_allclose(got.reshape(4, 2, 2, 1)[:, 1, :, 0], blocks[:, :, 0, 1])


def test_cast_varying_is_idempotent_and_marks_axes():
    def body(x, w):
        assert C.varying_axes(w) == frozenset()
        w = C.cast_varying(w, ("data", "model"))
        assert C.varying_axes(w) == frozenset({"data", "model"})
        w = C.cast_varying(w, "data")  # Already varying: no error.
        return x * w.sum()
    jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(P(("data", "model")), P()),
                          out_specs=P(("data", "model"))))(X, np.ones(3, np.float32))


@pytest.mark.parametrize("call", [
    lambda x: C.psum(x, "pipe"),
    lambda x: C.pmean(x, ("data", "pipe")),
    lambda x: C.all_gather(x, "expert"),
    lambda x: C.reduce_scatter(x, "seq"),
    lambda x: C.broadcast(x, "pipe"),
    lambda x: C.ppermute(x, "pipe", [(0, 1)]),
    lambda x: C.axis_index("pipe"),
])
def test_unknown_axis_lists_available_axes(call):
    with pytest.raises(errors.CollectiveError) as info:
        _run(lambda x: x + 0 * jnp.sum(call(x)))
    assert "does not exist" in info.value.message
    assert "data, model" in info.value.suggestion


def test_collectives_outside_shard_map_fail_clearly():
    with pytest.raises(errors.CollectiveError) as info:
        C.psum(jnp.ones(3), "data")
    assert "outside shard_map" in info.value.message and info.value.path == "mesh axis 'data'"
    with pytest.raises(errors.CollectiveError):
        jax.jit(lambda x: C.pmean(x, "data"))(jnp.ones(3))


def test_value_errors():
    with pytest.raises(errors.CollectiveError) as info:
        _run(lambda x: C.psum({"a": x, "name": "text"}, "data")["a"])
    assert "['name']" in info.value.message
    with pytest.raises(errors.CollectiveError) as info:
        _run(lambda x: C.reduce_scatter(x, "model", scatter_dimension=1))  # 3 % 2 != 0
    assert "not divisible by the size 2" in info.value.message
    with pytest.raises(errors.CollectiveError):
        _run(lambda x: C.reduce_scatter(x, "model", op="max"))
    with pytest.raises(errors.CollectiveError):
        _run(lambda x: C.broadcast(x, "model", src_index=2))
    with pytest.raises(errors.CollectiveError):
        _run(lambda x: C.ppermute(x, "model", [(0, 1), (1, 1)]))
    with pytest.raises(errors.CollectiveError):
        _run(lambda x: C.all_gather(x, "model", axis_index=5))
