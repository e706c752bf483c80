"""Attention sinks (gpt-oss): a per-head logit in every query's softmax, without a value --
written out, blockwise (through the log-sum-exp) and decoding against a cache, each against an
independent float64 computation, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from titanax.modules.layers.attention import Attention
from titanax.modules.module import functional
from tests.numerics import assert_close

pytestmark = pytest.mark.usefixtures("float64_numerics")

HEADS, KV, WIDTH, MODEL = 4, 2, 8, 32


def _layer(**changes):
    return Attention.default_config().set(
        name="attn", model_dim=MODEL, num_heads=HEADS, num_kv_heads=KV, head_dim=WIDTH,
        rotary=False, sinks=True, sliding_window=6, **changes).instantiate()


def _params(layer, seed=0):
    rng = np.random.default_rng(seed)
    params = layer.initialize_parameters_recursively(jax.random.PRNGKey(seed))
    params = jax.tree_util.tree_map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 0.4), params)
    params["sinks"] = jnp.asarray([2.0, -1.0, 0.5, 4.0])  # (One head mostly attends to nothing.)
    return params


def _reference(params, x):
    """The layer written out: q/k/v, causal scores within the window, the sink as one more
    column of each head's softmax (dropped after it), the output projection."""
    q = jnp.einsum("bsd,dhk->bshk", x, params["q_weight"])
    k = jnp.repeat(jnp.einsum("bsd,dhk->bshk", x, params["k_weight"]), HEADS // KV, axis=2)
    v = jnp.repeat(jnp.einsum("bsd,dhk->bshk", x, params["v_weight"]), HEADS // KV, axis=2)
    scores = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(WIDTH)
    t = x.shape[1]
    places = np.arange(t)
    seen = (places[None, :] <= places[:, None]) & (places[None, :] > places[:, None] - 6)
    scores = jnp.where(seen, scores, -jnp.inf)
    sink = jnp.broadcast_to(params["sinks"][None, :, None, None], scores.shape[:-1] + (1,))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], -1), -1)[..., :-1]
    out = jnp.einsum("bhts,bshk->bthk", probs, v).reshape(x.shape[0], t, -1)
    return out @ params["o"]["weight"]


@pytest.mark.parametrize("implementation", ["dense", "blockwise"])
def test_sinks_equal_the_written_out_softmax(implementation):
    layer = _layer(implementation=implementation, block_size=4)
    params = _params(layer)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 13, MODEL)))
    cotangent = jnp.asarray(np.random.default_rng(2).normal(size=(2, 13, MODEL)))

    def ours(p, v):
        return jnp.sum(functional(layer, None, p, (v,), is_training=False)[0] * cotangent)

    def theirs(p, v):
        return jnp.sum(_reference(p, v) * cotangent)

    got, want = jax.value_and_grad(ours, (0, 1))(params, x), \
        jax.value_and_grad(theirs, (0, 1))(params, x)
    assert_close(got[0], want[0], bound=1e-12, what="outputs . cotangent")
    assert_close(got[1][0]["sinks"], want[1][0]["sinks"], bound=1e-10, what="the sinks' gradient")
    assert_close(got[1], want[1], bound=1e-10, what="every gradient")
    plain = jax.value_and_grad(theirs, (0, 1))({**params, "sinks": params["sinks"] - 50.0}, x)
    assert abs(float(plain[0]) - float(want[0])) > 1e-3  # (The sinks matter here.)


def test_decoding_with_sinks_is_the_forward():
    layer = _layer()
    params = _params(layer, seed=3)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 9, MODEL)))
    whole = functional(layer, None, params, (x,), is_training=False)[0]
    cache = (jnp.zeros((2, 9, KV, WIDTH)), jnp.zeros((2, 9, KV, WIDTH)))
    outputs = []
    for step in range(9):
        (out, cache), _ = functional(layer, None, params, {"x": x[:, step:step + 1],
                                                           "cache": cache, "start": step},
                                     method="decode", is_training=False)
        outputs.append(out)
    assert_close(jnp.concatenate(outputs, axis=1), whole, bound=1e-12, what="decoded outputs")
