"""``model.attention_implementation`` through the whole decoder: the loss and every gradient of
a GQA Llama-like model on packed rows are the same with the written-out, blockwise and Pallas
attention (float32, SGD's raw gradients; the kernels' own cases are in tests/modules/layers)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.numerics import assert_close, float32_bound
from titanax.modules import functional
from titanax.modules.models.decoder import Decoder

SEQ = 40
BASE = dict(name="decoder", vocab_size=64, max_seq_len=SEQ, num_layers=2, model_dim=32,
            hidden_dim=48, num_heads=4, num_kv_heads=2, rope_theta=10000.0,
            attention_block_size=16)


@functools.lru_cache(maxsize=None)
def _loss_and_grads(implementation: str):
    model = Decoder.default_config().set(
        **BASE, attention_implementation=implementation).instantiate()
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, SEQ), 0, BASE["vocab_size"])
    # Row 0 packs three documents (positions restart in each), row 1 holds one.
    lengths = [(10, 22, 8), (SEQ,)]
    segments = np.stack([np.repeat(np.arange(1, len(l) + 1), l) for l in lengths])
    positions = np.stack([np.concatenate([np.arange(n) for n in l]) for l in lengths])
    batch = {"input_ids": ids, "target_ids": jnp.roll(ids, -1, axis=1),
             "segment_ids": jnp.asarray(segments), "positions": jnp.asarray(positions)}

    def loss(p):
        return functional(model, None, p, (batch,), is_training=False)[0][0]

    return jax.value_and_grad(loss)(params)


@pytest.mark.parametrize("implementation", ["blockwise", "pallas"])
def test_the_loss_and_every_gradient_equal_the_written_out_attention(implementation):
    want_loss, want_grads = _loss_and_grads("dense")
    got_loss, got_grads = _loss_and_grads(implementation)
    bound = float32_bound(SEQ * BASE["model_dim"])
    assert_close(got_loss, want_loss, bound=bound, what=f"{implementation}: loss")
    assert_close(got_grads, want_grads, bound=bound, what=f"{implementation}: gradients",
                 scale="tree")
