"""The LM head and loss in chunks of tokens against the whole, on one device and under TP's
vocabulary split: loss and every gradient (float64), per-token losses, chunk lengths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.modules.models import tensor_parallel_parity
from tests.numerics import assert_close
from titanax.modules import functional
from titanax.modules.layers.chunked_loss import chunk_length, chunked_token_losses
from titanax.modules.models.decoder import Decoder

pytestmark = pytest.mark.usefixtures("float64_numerics")

# vocab 61 (padded to 64: the padding rows are masked per chunk too).
BASE = dict(name="decoder", vocab_size=61, max_seq_len=16, num_layers=1, model_dim=32,
            num_heads=4, num_kv_heads=2, hidden_dim=48, vocab_pad_multiple=8)


def _model(chunk):
    return Decoder.default_config().set(**BASE, loss_chunk_tokens=chunk).instantiate()


@pytest.mark.parametrize("chunk", [1, 5, 32, 128])  # (8 x 16 tokens: 5 leaves a part chunk.)
def test_chunked_loss_and_gradients_equal_the_whole_on_one_device(chunk):
    params, batch, loss, grads = tensor_parallel_parity.one_device(
        _model(None), vocab_size=BASE["vocab_size"], perturb=True)
    chunked = _model(chunk)
    got, got_grads = jax.value_and_grad(
        lambda p: functional(chunked, None, p, (batch,), is_training=False)[0][0])(params)
    assert_close(got, loss, what=f"loss, chunks of {chunk}")
    assert_close(got_grads, grads, what=f"gradients, chunks of {chunk}")


def test_chunked_loss_under_tensor_parallel_vocabulary_split_equals_one_device():
    params, batch, loss, grads = tensor_parallel_parity.one_device(
        _model(None), vocab_size=BASE["vocab_size"], perturb=True)
    (tp_loss, tp_grads), _ = tensor_parallel_parity.tensor_parallel(
        _model(5), params, batch, tp_size=2)
    assert_close(tp_loss, loss, what="TP chunked loss")
    assert_close(tp_grads, grads, what="TP chunked gradients")


def test_per_token_losses_keep_their_places_and_chunks_follow_the_vocabulary():
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(3, 7, 4)))
    targets = jnp.asarray(rng.integers(0, 4, size=(3, 7)))
    table = jnp.asarray(rng.normal(size=(4, 4)))

    def loss_of_chunk(h, t):
        return -jax.nn.log_softmax(h @ table.T)[jnp.arange(t.shape[0]), t]

    whole = loss_of_chunk(hidden.reshape(21, 4), targets.reshape(21)).reshape(3, 7)
    chunked = chunked_token_losses(hidden, targets, loss_of_chunk=loss_of_chunk, chunk=4)
    assert chunked.shape == (3, 7)
    assert_close(chunked, whole, what="per-token losses")
    assert chunk_length(tokens=4096, local_vocab=256) == 4096  # Small vocabulary: unchunked.
    assert chunk_length(tokens=4096, local_vocab=131072) == 128  # 2^24 logits per chunk.
    assert chunk_length(tokens=4096, local_vocab=131072, requested=1000) == 1000
