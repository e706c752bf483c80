"""The Pallas flash-attention kernel (pallas_attention.py) against the written-out attention:
outputs and gradients in float32, run on CPU in Pallas' interpret mode (the GPU runs the same
kernel compiled by Triton: benchmarks/attention_kernels.py checks it there). Blocks of 16 so the
rows cross several blocks, forward and backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.numerics import assert_close, float32_bound
from titanax.errors import ConfigError
from titanax.modules.layers.attention import Attention, attend
from titanax.modules.layers.pallas_attention import pallas_attention
from titanax.modules.layers.softmax_attention import masked_attention

# name: (tokens, query heads, kv heads, head width, packed)
CASES = {
    "causal": (48, 2, 2, 16, False),
    "gqa": (48, 4, 2, 16, False),
    "mqa segments": (48, 4, 1, 16, True),
    # 40 tokens: padded to 48 (3 blocks); width 12: padded to 16.
    "uneven": (40, 2, 1, 12, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pallas_kernel_equals_written_out_attention(name):
    s, n, g, d, packed = CASES[name]
    rng = np.random.default_rng(len(name))
    b = 2
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in
               ((b, s, n, d), (b, s, g, d), (b, s, g, d)))
    weights = jnp.asarray(rng.normal(size=(b, s, n, d)), jnp.float32)
    # Row 0: three documents of uneven lengths; row 1: one.
    segments = (np.stack([np.repeat([1, 2, 3], [s // 4, s // 2, s - s // 4 - s // 2]),
                          np.ones(s, int)]) if packed else None)
    # The mask, written independently of both kernels: causal, same document.
    allowed = np.tril(np.ones((s, s), bool))[None, None]
    if packed:
        allowed = allowed & (segments[:, :, None] == segments[:, None, :])[:, None]
    scale = d ** -0.5

    def dense(q, k, v):
        out = masked_attention(q, k, v, jnp.asarray(allowed), scale=scale)
        return jnp.sum(out * weights), out

    def pallas(q, k, v):
        out = pallas_attention(q, k, v, scale=scale, block_size=16,
                               segment_ids=None if segments is None else jnp.asarray(segments))
        assert out.shape == q.shape
        return jnp.sum(out * weights), out

    (_, want), want_grads = jax.value_and_grad(dense, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    (_, got), got_grads = jax.value_and_grad(pallas, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    # Outputs: sums of s keys' terms; the kv gradients: of s * n / g. (The outputs, not their
    # weighted sum: a sum of terms of both signs cancels, and its roundoff is the terms'.)
    bound = float32_bound(s * n // g)
    assert_close(got, want, bound=float32_bound(s), what=f"{name}: outputs", scale="tree")
    assert_close(got_grads, want_grads, bound=bound, what=f"{name}: dq, dk, dv", scale="tree")


def test_attend_decodes_with_the_pallas_choice_blockwise():
    """Decoding against a cache (queries fewer than the keys) is not the kernel's: attend runs
    it blockwise, with the same numbers as the written-out attention."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, 2, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, 24, 2, 16)), jnp.float32) for _ in range(2))
    got = attend(q, k, v, kv_length=10, implementation="pallas", block_size=8)
    want = attend(q, k, v, kv_length=10, implementation="dense")
    assert_close(got, want, bound=float32_bound(24), scale="tree")


def test_pallas_with_a_sliding_window_is_refused_by_config():
    cfg = Attention.default_config().set(name="attn", model_dim=32, num_heads=2,
                                         sliding_window=8, implementation="pallas")
    with pytest.raises(ConfigError, match="sliding window"):
        cfg.instantiate()
