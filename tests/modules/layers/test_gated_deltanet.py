"""The Gated DeltaNet layer against transformers' Qwen 3.5 layer with the same weights; packed
documents computed as if alone; tensor parallelism (value and key heads split) against one
device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from titanax.modules import functional
from titanax.modules.layers.gated_deltanet import GatedDeltaNet
from titanax.modules.testing import bind
from titanax.parallel import axis_binding
from titanax.parallel.plan import TP, Plan
from titanax.runtime.mesh import MeshSpec
from tests.numerics import assert_close

SIZES = dict(model_dim=32, num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6,
             conv_kernel_size=4)


def _layer(**changes):
    return GatedDeltaNet.default_config().set(name="mixer", **{**SIZES, **changes}).instantiate()


def _random_params(layer, seed=0):
    """Every param random (the decay's and the norm's too, which start as constants)."""
    params = layer.initialize_parameters_recursively(jax.random.PRNGKey(seed))
    rng = np.random.default_rng(seed)
    params = jax.tree_util.tree_map(
        lambda p: jnp.asarray(rng.normal(size=p.shape) * 0.3, p.dtype), params)
    params["a_log"] = jnp.asarray(rng.uniform(-1.0, 1.0, size=params["a_log"].shape),
                                  jnp.float32)
    params["norm_scale"] = 1.0 + params["norm_scale"]
    return params


def _hf_state(params):
    """Our params as transformers' Qwen3_5GatedDeltaNet state dict ([out, in] weights; q, k and
    v one after the other in in_proj_qkv and conv1d)."""
    torch = pytest.importorskip("torch")
    p = {k: np.asarray(v, np.float32) for k, v in params.items() if k != "o"}
    d = p["q_weight"].shape[0]
    flat = lambda w: w.reshape(d, -1).T  # noqa: E731  [d, heads, width] -> [heads*width, d]
    taps = lambda w: w.reshape(w.shape[0], -1).T[:, None, :]  # noqa: E731  -> [c, 1, K]
    state = {
        "in_proj_qkv.weight": np.concatenate([flat(p[f"{n}_weight"]) for n in "qkv"]),
        "conv1d.weight": np.concatenate([taps(p[f"{n}_conv"]) for n in "qkv"]),
        "in_proj_z.weight": flat(p["z_weight"]), "in_proj_a.weight": p["a_weight"].T,
        "in_proj_b.weight": p["b_weight"].T, "dt_bias": p["dt_bias"], "A_log": p["a_log"],
        "norm.weight": p["norm_scale"],
        "out_proj.weight": np.asarray(params["o"]["weight"], np.float32).T}
    return {k: torch.tensor(np.ascontiguousarray(v)) for k, v in state.items()}


def test_the_layer_equals_transformers_qwen3_5_layer():
    """37 tokens (chunks of 16: a part chunk), 2 key heads serving 4 value heads, float32:
    within float32's rounding of the outputs' scale."""
    torch = pytest.importorskip("torch")
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    from transformers.models.qwen3_5.configuration_qwen3_5 import (  # pylint: disable=import-outside-toplevel
        Qwen3_5TextConfig)
    layer = _layer(chunk_size=16)
    params = _random_params(layer)
    x = np.random.default_rng(1).normal(size=(2, 37, 32)).astype(np.float32)
    with bind(layer, params):
        ours = np.asarray(layer(jnp.asarray(x)))
    config = Qwen3_5TextConfig(
        hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1,
        layer_types=["linear_attention"])
    theirs_layer = qwen.Qwen3_5GatedDeltaNet(config, layer_idx=0)
    theirs_layer.load_state_dict(_hf_state(params), strict=True)  # (Every weight, no other.)
    with torch.no_grad():
        theirs = theirs_layer(torch.tensor(x)).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=3e-5 * np.abs(theirs).max())


def test_packed_documents_are_computed_as_if_alone():
    """The convolution does not reach across a boundary and the state restarts: each document's
    outputs in a packed row are its outputs alone."""
    layer = _layer(chunk_size=8)
    params = _random_params(layer, seed=2)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(1, 30, 32)), jnp.float32)
    bounds = [(0, 7), (7, 20), (20, 30)]
    segments = jnp.asarray(np.concatenate([np.full(e - s, i) for i, (s, e) in
                                           enumerate(bounds)])[None])
    # (Each call one compiled program: op by op, each of its operations compiles on its own.)
    run = jax.jit(lambda p, inputs: functional(layer, None, p, inputs, is_training=False)[0])
    packed = run(params, {"x": x, "segment_ids": segments})
    for start, end in bounds:
        assert_close(packed[:, start:end], run(params, {"x": x[:, start:end]}),
                     what=f"document {start}:{end}")


def test_tensor_parallel_heads_equal_one_device():
    """Value heads and key heads split over model=2 (each device one key head and its two value
    heads), the output projection row-parallel: the outputs of one device."""
    layer = _layer(chunk_size=16)
    params = _random_params(layer, seed=4)
    x = jnp.asarray(np.random.default_rng(5).normal(size=(4, 20, 32)), jnp.float32)
    with bind(layer, params):
        want = layer(x)
    mesh = MeshSpec(axes=("data", "model"), shape=(None, 2)).build()
    binding = Plan(tensor_parallel=TP(axis="model")).axis_binding()
    with axis_binding.bound(binding):
        specs = layer.param_partition_specs()
    assert specs["q_weight"] == P(None, "model", None) and specs["z_weight"] == P(None, "model",
                                                                                  None)

    def local(p, v):
        with axis_binding.bound(binding):
            return functional(layer, None, p, (v,), is_training=False)[0]

    got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P("data")),
                                out_specs=P("data")))(params, x)
    assert_close(got, want, what="tensor-parallel outputs")


@pytest.mark.parametrize("load_balance", ["dual_chunk", "none"])
def test_context_parallel_equals_one_device(load_balance, float64_numerics):
    """Rows of 16 split over context=4 (CP's order: chunks r and 7-r per rank, of 2 tokens --
    fewer than the convolution reads back -- or chunk r, of 4), documents packed across the
    cuts: outputs and gradients (params and input) of one device (float64). The state crosses
    as affine maps, the convolution reads the tokens before each chunk."""
    del float64_numerics
    from titanax.parallel.context_parallel import dual_chunk_order
    from titanax.parallel.plan import CP
    layer = _layer(chunk_size=3)
    params = jax.tree_util.tree_map(lambda p: jnp.asarray(p, jnp.float64),
                                    _random_params(layer, seed=6))
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(2, 16, 32)))
    # Documents end inside chunks and on their edges.
    lengths = [5, 3, 4, 1, 3]
    segments = jnp.asarray(np.stack([np.repeat(np.arange(5), lengths),
                                     np.repeat(np.arange(5), lengths[::-1])]))
    cotangent = jnp.asarray(rng.normal(size=(2, 16, 32)))

    def loss(p, v, seg, run):
        return jnp.sum(run(p, v, seg) * cotangent[:, order])

    def alone(p, v, seg):
        return functional(layer, None, p, {"x": v, "segment_ids": seg}, is_training=False)[0]

    order = np.arange(16)
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=3)(
        params, x, segments, alone)
    mesh = MeshSpec(axes=("data", "context"), shape=(2, 4)).build()
    binding = Plan(context_parallel=CP(axis="context", load_balance=load_balance)).axis_binding()

    def local(p, v, seg):
        with axis_binding.bound(binding):
            return functional(layer, None, p, {"x": v, "segment_ids": seg}, is_training=False)[0]

    split = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data", "context"),
                                                      P("data", "context")),
                          out_specs=P("data", "context"))
    order = dual_chunk_order(16, 4) if load_balance == "dual_chunk" else np.arange(16)
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=3)(
        params, x[:, order], segments[:, order], split)
    assert_close(got[0], want[0], bound=1e-9, what="the loss")
    assert_close(got[1][0], want[1][0], bound=1e-9, what="params' gradients")
    assert_close(got[1][1], want[1][1][:, order], bound=1e-9, what="the input's gradient")
