"""Multi-head latent attention against transformers' DeepSeek-V3 attention with the same weights
(its interleaved RoPE pairs permuted once to rotate-half), decoding with the latent cache against
the full forward, and tensor parallelism (heads split) against one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from titanax.modules import functional
from titanax.modules.layers import rotary
from titanax.modules.layers.latent_attention import MultiHeadLatentAttention
from titanax.parallel import axis_binding
from titanax.parallel.plan import TP, Plan
from titanax.runtime.mesh import MeshSpec
from tests.numerics import CROSS_FRAMEWORK, assert_close

SIZES = dict(model_dim=32, num_heads=4, kv_lora_rank=12, qk_nope_head_dim=8,
             qk_rope_head_dim=6, v_head_dim=5)
YARN = dict(factor=4.0, original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=1.0)


def _layer(**changes):
    return MultiHeadLatentAttention.default_config().set(
        name="mla", **{**SIZES, **changes}).instantiate()


def _random(layer, seed=0):
    rng = np.random.default_rng(seed)
    params = layer.initialize_parameters_recursively(jax.random.PRNGKey(seed))
    return jax.tree_util.tree_map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 0.4,
                                                        jnp.float32), params)


def _interleaved(rows):
    """HF's interleaved pair order of ``rows`` RoPE features -> Titanax's rotate-half order."""
    return np.concatenate([np.arange(0, rows, 2), np.arange(1, rows, 2)])


@pytest.mark.parametrize("q_lora_rank", [None, 10])
def test_the_layer_equals_transformers_deepseek_v3_attention(q_lora_rank):
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention, DeepseekV3RotaryEmbedding)
    layer = _layer(q_lora_rank=q_lora_rank, rope_theta=1000.0,
                   rope_scaling=rotary.YarnRopeScaling.default_config().set(**YARN))
    params = _random(layer)
    config = DeepseekV3Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
        kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=5,
        max_position_embeddings=64, rope_interleave=True, attention_bias=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, **YARN})
    config._attn_implementation = "eager"  # pylint: disable=protected-access
    theirs = DeepseekV3Attention(config, layer_idx=0).eval()
    nope, rope, v = 8, 6, 5
    back = np.argsort(_interleaved(rope))  # Titanax order -> HF's interleaved order.

    def heads_to_hf(w):  # [in, h, nope + rope] (Titanax order) -> [h * (nope + rope), in]
        w = np.asarray(w)
        w = np.concatenate([w[..., :nope], w[..., nope:][..., back]], -1)
        return w.reshape(w.shape[0], -1).T

    p = {k: np.asarray(val) for k, val in params.items() if not isinstance(val, dict)}
    kv_a = np.concatenate([p["kv_a_weight"][:, :12], p["kv_a_weight"][:, 12:][:, back]], 1)
    state = {"kv_a_proj_with_mqa.weight": kv_a.T,
             "kv_a_layernorm.weight": np.asarray(params["kv_norm"]["scale"]),
             "kv_b_proj.weight": p["kv_b_weight"].reshape(12, -1).T,
             "o_proj.weight": np.asarray(params["o"]["weight"]).T}
    if q_lora_rank is None:
        state["q_proj.weight"] = heads_to_hf(p["q_weight"])
    else:
        state.update({"q_a_proj.weight": p["q_a_weight"].T,
                      "q_a_layernorm.weight": np.asarray(params["q_norm"]["scale"]),
                      "q_b_proj.weight": heads_to_hf(p["q_b_weight"])})
    theirs.load_state_dict({k: torch.tensor(np.ascontiguousarray(val))
                            for k, val in state.items()}, strict=True)
    x = np.random.default_rng(1).normal(size=(2, 11, 32)).astype(np.float32)
    positions = torch.arange(11)[None].expand(2, -1)
    cos_sin = DeepseekV3RotaryEmbedding(config)(torch.tensor(x), positions)
    mask = torch.full((11, 11), float("-inf")).triu(1)[None, None].expand(2, 1, -1, -1)
    with torch.no_grad():
        want = theirs(torch.tensor(x), cos_sin, mask)[0].numpy()
    got = functional(layer, None, params, (jnp.asarray(x),), is_training=False)[0]
    assert np.std(want) > 0.1
    assert_close(got, want, bound=CROSS_FRAMEWORK, what="MLA outputs")


def test_decoding_with_the_latent_cache_is_the_forward():
    layer = _layer(q_lora_rank=10, sliding_window=5)
    params = _random(layer, seed=2)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 9, 32)), jnp.float32)
    whole = functional(layer, None, params, (x,), is_training=False)[0]
    cache = (jnp.zeros((2, 9, 12)), jnp.zeros((2, 9, 6)))
    # (Each piece one compiled program: op by op, each of its operations compiles on its own.)
    decode = jax.jit(lambda params, x, cache, start: functional(
        layer, None, params, {"x": x, "cache": cache, "start": start}, method="decode",
        is_training=False)[0], static_argnums=3)
    pieces = []
    for start, stop in ((0, 4), (4, 5), (5, 6), (6, 9)):  # A prefill, then steps.
        out, cache = decode(params, x[:, start:stop], cache, start)
        pieces.append(out)
    assert_close(jnp.concatenate(pieces, 1), whole, what="decoded outputs")


def test_tensor_parallel_heads_equal_one_device():
    layer = _layer(q_lora_rank=10)
    params = _random(layer, seed=4)
    x = jnp.asarray(np.random.default_rng(5).normal(size=(4, 10, 32)), jnp.float32)
    want = functional(layer, None, params, (x,), is_training=False)[0]
    mesh = MeshSpec(axes=("data", "model"), shape=(None, 2)).build()
    binding = Plan(tensor_parallel=TP(axis="model")).axis_binding()
    with axis_binding.bound(binding):
        specs = layer.param_partition_specs()
    assert specs["kv_b_weight"] == P(None, "model", None)
    assert "model" not in tuple(specs["kv_a_weight"])  # (The latent projection stays whole.)

    def local(p, v):
        with axis_binding.bound(binding):
            return functional(layer, None, p, (v,), is_training=False)[0]

    got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P("data")),
                                out_specs=P("data")))(params, x)
    assert_close(got, want, what="tensor-parallel outputs")
