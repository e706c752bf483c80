"""Blockwise attention (O(S) memory) against the written-out attention: outputs and gradients,
float64, for every mask it skips tiles by."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.numerics import assert_close
from titanax.modules.layers.blockwise_attention import blockwise_attention
from titanax.modules.layers.softmax_attention import masked_attention

pytestmark = pytest.mark.usefixtures("float64_numerics")

# name: (queries t, keys s, query heads, kv heads, window, packed, filled keys, block)
CASES = {
    "causal": (24, 24, 4, 4, None, False, None, 8),
    "gqa": (24, 24, 4, 2, None, False, None, 8),
    "mqa": (24, 24, 4, 1, None, False, None, 8),
    "window": (24, 24, 4, 2, 5, False, None, 8),
    "segments": (24, 24, 4, 2, None, True, None, 8),
    "uneven blocks": (21, 21, 2, 1, 4, True, None, 8),
    "one block": (12, 12, 2, 2, None, False, None, 64),
    "decoding": (3, 24, 4, 2, None, False, 15, 8),
}


def _mask(q_pos, k_pos, q_seg, k_seg, window, filled):
    """[b, 1, t, s], written independently of the kernel."""
    allowed = k_pos[:, None, :] <= q_pos[:, :, None]
    allowed &= q_seg[:, :, None] == k_seg[:, None, :]
    if window is not None:
        allowed &= k_pos[:, None, :] > q_pos[:, :, None] - window
    if filled is not None:
        allowed &= (np.arange(k_pos.shape[1]) < filled)[None, None, :]
    return allowed[:, None]


@pytest.mark.parametrize("name", list(CASES))
def test_blockwise_equals_written_out_attention(name):
    t, s, n, g, window, packed, filled, block = CASES[name]
    rng = np.random.default_rng(len(name))
    b, d = 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=shape)) for shape in
               ((b, t, n, d), (b, s, g, d), (b, s, g, d)))
    weights = jnp.asarray(rng.normal(size=(b, t, n, d)))
    end = s if filled is None else filled
    q_pos = np.broadcast_to(np.arange(end - t, end), (b, t))
    k_pos = np.broadcast_to(np.arange(s), (b, s))
    if packed:  # Row 0: three documents; row 1: one.
        k_seg = np.stack([np.repeat([1, 2, 3], [s // 3, s // 3, s - 2 * (s // 3)]),
                          np.ones(s, int)])
    else:
        k_seg = np.zeros((b, s), int)
    q_seg = k_seg[:, s - t:] if filled is None else k_seg[:, filled - t:filled]
    allowed = jnp.asarray(_mask(q_pos, k_pos, q_seg, k_seg, window, filled))
    scale = d ** -0.5

    def dense(q, k, v):
        return jnp.sum(masked_attention(q, k, v, allowed, scale=scale) * weights)

    def blockwise(q, k, v):
        out = blockwise_attention(
            q, k, v, scale=scale, q_positions=jnp.asarray(q_pos), k_positions=jnp.asarray(k_pos),
            q_segments=jnp.asarray(q_seg) if packed else None,
            k_segments=jnp.asarray(k_seg) if packed else None, sliding_window=window,
            kv_length=filled, block_q=block, block_k=block)
        assert out.shape == q.shape
        return jnp.sum(out * weights)

    want, want_grads = jax.value_and_grad(dense, argnums=(0, 1, 2))(q, k, v)
    got, got_grads = jax.value_and_grad(blockwise, argnums=(0, 1, 2))(q, k, v)
    assert_close(got, want, what=f"{name}: loss")
    assert_close(got_grads, want_grads, what=f"{name}: dq, dk, dv")


def test_a_query_that_sees_no_key_gets_zeros_and_no_gradient():
    q = jnp.ones((1, 4, 2, 8))
    kv = jnp.ones((1, 4, 2, 8))
    # Query 0 is in document 1, every key in document 2.
    segments = (jnp.asarray([[1, 2, 2, 2]]), jnp.asarray([[2, 2, 2, 2]]))

    def loss(q):
        out = blockwise_attention(q, kv, kv, scale=1.0, q_positions=jnp.arange(4),
                                  k_positions=jnp.arange(4), q_segments=segments[0],
                                  k_segments=segments[1], block_q=2, block_k=2)
        return jnp.sum(out), out

    grads, out = jax.grad(loss, has_aux=True)(q)
    assert np.all(np.asarray(out[0, 0]) == 0) and np.all(np.isfinite(np.asarray(grads)))
    assert np.all(np.asarray(grads[0, 0]) == 0)


def _step_temp_bytes(implementation: str, seq_len: int) -> int:
    """Temp bytes of a one-layer decoder's compiled gradient (layers under lax.scan, as the
    model runs them) at ``seq_len`` tokens."""
    from titanax.modules import functional  # pylint: disable=import-outside-toplevel
    from titanax.modules.models.decoder import Decoder  # pylint: disable=import-outside-toplevel
    model = Decoder.default_config().set(
        name="d", vocab_size=64, max_seq_len=seq_len, num_layers=2, model_dim=32, num_heads=4,
        num_kv_heads=2, hidden_dim=64, unroll_layers=False,
        attention_implementation=implementation, attention_block_size=128).instantiate()
    params = jax.eval_shape(lambda: model.initialize_parameters_recursively(
        jax.random.PRNGKey(0)))
    batch = {name: jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
             for name in ("input_ids", "target_ids")}
    loss = lambda p, b: functional(model, None, p, (b,), is_training=True)[0][0]  # noqa: E731
    compiled = jax.jit(jax.grad(loss)).lower(params, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_memory_grows_linearly_in_the_sequence_where_dense_grows_quadratically():
    blockwise = [_step_temp_bytes("blockwise", s) for s in (1024, 2048)]
    dense = [_step_temp_bytes("dense", s) for s in (1024, 2048)]
    assert blockwise[1] / blockwise[0] <= 2.3, blockwise
    assert dense[1] / dense[0] >= 3.0, dense  # (What this test would see without blocks.)
