"""Layers against numpy references, and their tensor-parallel modes against one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from titanax.modules import functional
from titanax.parallel import axis_binding
from titanax.modules.layers.attention import Attention, attend
from titanax.modules.layers.decoder_block import DecoderBlock
from titanax.modules.layers.dropout import Dropout
from titanax.modules.layers.linear import Linear
from titanax.modules.layers.norm import LayerNorm, RMSNorm
from titanax.modules.layers.repeat import Repeat
from titanax.modules.testing import bind
from titanax.parallel import collectives
from titanax.parallel.plan import TP, Plan
from titanax.runtime.mesh import MeshSpec
from tests.numerics import FLOAT32, assert_close


MESH = MeshSpec(axes=("data", "model"), shape=(None, 2)).build()
TP_BINDING = Plan(tensor_parallel=TP(axis="model")).axis_binding()
RNG = np.random.default_rng(0)


def _init(layer):
    return layer.initialize_parameters_recursively(jax.random.PRNGKey(0))


def test_linear_matches_numpy():
    layer = Linear.default_config().set(name="l", input_dim=3, output_dim=2).instantiate()
    params = {"weight": jnp.asarray(RNG.normal(size=(3, 2)), jnp.float32),
              "bias": jnp.asarray([1.0, -1.0])}
    x = RNG.normal(size=(4, 3)).astype(np.float32)
    with bind(layer, params):
        out = layer(x)
    assert_close(out, x @ np.asarray(params["weight"]) + [1.0, -1.0])


@pytest.mark.parametrize("parallel", ["column", "row"])
def test_linear_parallel_modes_match_one_device(parallel):
    ref = Linear.default_config().set(name="l", input_dim=4, output_dim=6).instantiate()
    # The layer names its hidden features "mlp" (input: row-parallel; output: column).
    named = {"row": dict(input_dim_name="mlp"), "column": dict(output_dim_name="mlp")}[parallel]
    tp = Linear.default_config().set(name="l", input_dim=4, output_dim=6,
                                     **named).instantiate()
    params = _init(ref)
    params["bias"] = jnp.arange(6.0)
    x = jnp.asarray(RNG.normal(size=(8, 4)), jnp.float32)
    with bind(ref, params):
        want = ref(x)
    with axis_binding.bound(TP_BINDING):
        specs = tp.param_partition_specs()
    in_x = P("data", "model") if parallel == "row" else P("data")
    out_spec = P("data", "model") if parallel == "column" else P("data")

    def local(p, v):
        with axis_binding.bound(TP_BINDING):
            return functional(tp, None, p, (v,), is_training=False)[0]

    got = jax.jit(jax.shard_map(local, mesh=MESH, in_specs=(specs, in_x), out_specs=out_spec))(
        params, x)
    assert_close(got, want, what="tensor-parallel output")


def test_norms_match_numpy():
    x = RNG.normal(size=(2, 5)).astype(np.float32) * 3 + 1
    layer_norm = LayerNorm.default_config().set(name="ln", input_dim=5).instantiate()
    params = {"scale": jnp.full((5,), 2.0), "bias": jnp.full((5,), 0.5)}
    with bind(layer_norm, params):
        out = layer_norm(x)
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * 2 + 0.5
    assert_close(out, want, what="layer norm")
    rms = RMSNorm.default_config().set(name="rms", input_dim=5).instantiate()
    with bind(rms, {"scale": jnp.full((5,), 3.0)}):
        out = rms(x)
    assert_close(out, x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6) * 3, what="RMS norm")
    with bind(layer_norm, params):
        assert layer_norm(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16


def test_dropout_rate_scaling_and_eval_identity():
    layer = Dropout.default_config().set(name="d", rate=0.25).instantiate()
    x = jnp.ones((200, 200))
    with bind(layer, {}, prng_key=jax.random.PRNGKey(0), is_training=True):
        out = np.asarray(layer(x))
    assert abs((out == 0).mean() - 0.25) < 0.01
    assert_close(out[out != 0], np.full(int((out != 0).sum()), 1 / 0.75), what="kept units")
    with bind(layer, {}, prng_key=jax.random.PRNGKey(0), is_training=False):
        np.testing.assert_array_equal(layer(x), x)


@pytest.mark.parametrize("split_over_tp", [False, True])
def test_dropout_masks_across_tensor_parallel_ranks(split_over_tp):
    # Activations split along "heads" (bound to the TP axis) draw a mask per rank.
    layer = Dropout.default_config().set(name="d", rate=0.5,
                                         split_dims=("heads",) if split_over_tp else ()
                                         ).instantiate()

    def local(x):
        with axis_binding.bound(TP_BINDING):
            mask = functional(layer, jax.random.PRNGKey(0), {}, (x,), is_training=True)[0]
        return collectives.all_gather(mask, "model")[None]

    masks = jax.jit(jax.shard_map(local, mesh=MESH, in_specs=P(), out_specs=P(("data", "model"))))(
        jnp.ones((64,)))
    ranks_agree = np.array_equal(np.asarray(masks[0, 0]), np.asarray(masks[0, 1]))
    assert ranks_agree is (not split_over_tp)


def test_attention_is_causal():
    layer = Attention.default_config().set(name="a", model_dim=8, num_heads=2).instantiate()
    params = _init(layer)
    x = jnp.asarray(RNG.normal(size=(1, 6, 8)), jnp.float32)
    changed = x.at[:, 4:].set(5.0)
    with bind(layer, params):
        a, b = layer(x), layer(changed)
    assert_close(a[:, :4], b[:, :4], what="outputs before the change")
    assert not np.allclose(a[:, 4:], b[:, 4:])


def _reference_attention(params, x, num_heads):
    """Attention written out as wave 1 computed it: float32 scores, a materialised causal mask."""
    qkv = jnp.einsum("bsd,dthk->bsthk", x, params["qkv_weight"]) + params["qkv_bias"]
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), dtype=bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(jnp.float32).min), axis=-1)
    context = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)
    context = context.reshape(context.shape[:2] + (-1,))
    return context @ params["o"]["weight"] + params["o"]["bias"]


# float32: sums of at most 256 terms at the tree's scale (tests/numerics.py); bfloat16: its 8 bits.
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, FLOAT32), (jnp.bfloat16, 2e-2)])
def test_fused_attention_matches_the_written_out_formula(dtype, tol):
    # GPT-2's form: fused q/k/v with biases, an output bias, no rotation.
    layer = Attention.default_config().set(name="a", model_dim=16, num_heads=4, fused_qkv=True,
                                           qkv_bias=True, output_bias=True,
                                           rotary=False).instantiate()
    params = jax.tree_util.tree_map(
        lambda p: jnp.asarray(RNG.normal(size=p.shape) * 0.3, dtype), _init(layer))
    x = jnp.asarray(RNG.normal(size=(2, 12, 16)), dtype)
    want = _reference_attention(params, x, 4)
    got = functional(layer, None, params, (x,), is_training=False)[0]
    assert_close(np.asarray(got, np.float32), np.asarray(want, np.float32), bound=tol,
                 what="attention output")
    grad = jax.grad(lambda p: jnp.sum(functional(layer, None, p, (x,), is_training=False)[0]
                                      .astype(jnp.float32)))(params)
    want_grad = jax.grad(lambda p: jnp.sum(_reference_attention(p, x, 4)
                                           .astype(jnp.float32)))(params)
    assert_close(grad, want_grad, bound=tol * 10, scale="tree", what="gradients")
    # The written-out path (used for attention dropout in training), with an identity dropout.
    qkv = jnp.einsum("bsd,dthk->bsthk", x, params["qkv_weight"]) + params["qkv_bias"]
    written = attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout=lambda probs: probs)
    fused = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2],
                                         is_causal=True, scale=1 / np.sqrt(4))
    assert_close(np.asarray(written, np.float32), np.asarray(fused, np.float32), bound=tol,
                 what="written-out attention")


def test_repeat_equals_applying_the_layer_n_times():
    block = DecoderBlock.default_config().set(model_dim=8)
    block.attention.set(model_dim=8, num_heads=2)
    block.mlp.set(model_dim=8, hidden_dim=16, gated=False)
    stack = Repeat.default_config().set(name="stack", layer=block, num_layers=3).instantiate()
    single = block.clone(name="block").instantiate()
    params = _init(stack)
    assert params["layer"]["mlp"]["up"]["weight"].shape == (3, 8, 16)
    x = jnp.asarray(RNG.normal(size=(2, 4, 8)), jnp.float32)
    want = x
    for index in range(3):
        layer_params = jax.tree_util.tree_map(lambda p, i=index: p[i], params["layer"])
        want = functional(single, None, layer_params, (want,), is_training=False)[0]
    got = functional(stack, None, params, (x,), is_training=False)[0]
    assert_close(got, want, what="stack output")
    remat = stack.config.clone(layer_remat_policy="nothing_saveable").instantiate()
    grads = [jax.grad(lambda p, m=m: jnp.sum(functional(m, jax.random.PRNGKey(0), p, (x,),
                                                        is_training=True)[0]))(params)
             for m in (stack, remat)]
    assert_close(grads[0], grads[1], what="gradients with remat")
