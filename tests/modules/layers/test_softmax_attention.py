"""The written-out attention against numpy, with and without grouped queries and a mask."""

import jax.numpy as jnp
import numpy as np
import pytest

from tests.numerics import assert_close
from titanax.modules.layers.softmax_attention import masked_attention

RNG = np.random.default_rng(7)


def _numpy_attention(q, k, v, allowed, scale):
    """Per query head ``h``: the kv head ``h // group`` it reads, softmax over allowed keys."""
    b, t, n, d = q.shape
    group = n // k.shape[2]
    allowed = np.broadcast_to(allowed, (b, 1, t, k.shape[1]))
    out = np.zeros((b, t, n, v.shape[-1]))
    for h in range(n):
        scores = np.einsum("btd,bsd->bts", q[:, :, h], k[:, :, h // group]) * scale
        scores = np.where(allowed[:, 0], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[:, :, h] = np.einsum("bts,bsd->btd", probs, v[:, :, h // group])
    return out


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("per_row_mask", [False, True])
def test_masked_attention_equals_numpy(kv_heads, per_row_mask):
    b, t, n, d = 2, 6, 4, 8
    q = RNG.normal(size=(b, t, n, d))
    k, v = (RNG.normal(size=(b, t, kv_heads, d)) for _ in range(2))
    causal = np.tril(np.ones((t, t), bool))
    if per_row_mask:  # Two documents in row 0, one in row 1: [b, 1, t, s].
        segments = np.array([[0, 0, 0, 1, 1, 1], [0] * 6])
        allowed = causal & (segments[:, :, None] == segments[:, None, :])[:, None]
    else:
        allowed = causal
    got = masked_attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)),
                           jnp.asarray(allowed), scale=d ** -0.5)
    assert got.shape == (b, t, n, d)
    assert_close(np.asarray(got, np.float64), _numpy_attention(q, k, v, allowed, d ** -0.5),
                 what=f"attention, {kv_heads} kv heads")
    dropped = masked_attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)),
                               jnp.asarray(allowed), scale=d ** -0.5,
                               dropout=lambda probs: jnp.zeros_like(probs))
    assert not np.any(np.asarray(dropped)), "dropout is applied to the probabilities"
