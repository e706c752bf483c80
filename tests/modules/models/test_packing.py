"""Packed rows: several documents per row, with segment ids and per-document positions.

A packed batch must give every document exactly what it gets alone: the same logits at its
tokens, the same per-token losses, and gradients that add up over the documents -- with learned
positions (GPT) and with RoPE (the decoder), on one device and under data x tensor parallelism.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.modules.models import tensor_parallel_parity
from tests.numerics import assert_close, parity_floats
from titanax.modules import functional
from titanax.modules.models.decoder import Decoder
from titanax.modules.models.decoder import gpt_config

pytestmark = pytest.mark.usefixtures("float64_numerics")

VOCAB, ROW = 64, 16
# Each row's documents (their lengths in input/target pairs); the rest of a row is padding.
ROWS = [(5, 8, 3), (7, 6), (16,), (4, 4, 4, 2), (9, 5), (3, 3, 3, 3, 3), (10,), (6, 6, 2)]
MODELS = {
    "gpt": gpt_config().set(name="gpt", vocab_size=VOCAB, max_seq_len=ROW, num_layers=2,
                                    model_dim=32, num_heads=4),
    "decoder": Decoder.default_config().set(name="decoder", vocab_size=VOCAB, max_seq_len=ROW,
                                            num_layers=2, model_dim=32, num_heads=4,
                                            num_kv_heads=2, hidden_dim=48),
}


@functools.lru_cache(maxsize=None)
def _documents():
    """Every document as (input ids, target ids), and the packed batch of them all."""
    rng = np.random.default_rng(0)
    documents, fields = [], {k: np.zeros((len(ROWS), ROW), np.int32)
                             for k in ("input_ids", "target_ids", "segment_ids", "positions")}
    weights = np.zeros((len(ROWS), ROW), np.float32)
    for r, lengths in enumerate(ROWS):
        start = 0
        for segment, n in enumerate(lengths, start=1):
            tokens = rng.integers(0, VOCAB, n + 1).astype(np.int32)
            documents.append((r, start, tokens[:-1], tokens[1:]))
            fields["input_ids"][r, start:start + n] = tokens[:-1]
            fields["target_ids"][r, start:start + n] = tokens[1:]
            fields["segment_ids"][r, start:start + n] = segment
            fields["positions"][r, start:start + n] = np.arange(n)
            weights[r, start:start + n] = 1.0
            start += n
    return documents, {**fields, "weights": weights}


def _params(name):
    model = MODELS[name].instantiate()
    params = jax.jit(model.initialize_parameters_recursively)(jax.random.PRNGKey(0))
    return model, parity_floats(params)


def _loss_sum(model, params, batch):
    (_, aux), _ = functional(model, None, params, (batch,), is_training=False)
    return aux["loss_sum"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_document_gets_what_it_gets_alone(name):
    model, params = _params(name)
    documents, packed = _documents()
    batch = {k: jnp.asarray(v) for k, v in packed.items()}
    logits_of = jax.jit(lambda p, *inputs: functional(model, None, p, inputs, method="logits",
                                                      is_training=False)[0])
    grad_sum = jax.jit(jax.grad(lambda p, b: _loss_sum(model, p, b)))
    logits = logits_of(params, batch["input_ids"], batch["segment_ids"], batch["positions"])
    packed_grads = grad_sum(params, batch)
    # Each document alone in its own row, padded at its end (causal: the padding comes after
    # everything the document sees; its targets weigh 0): one compile, not one per length.
    alone = {"input_ids": np.zeros((len(documents), ROW), np.int32),
             "target_ids": np.zeros((len(documents), ROW), np.int32),
             "weights": np.zeros((len(documents), ROW), np.float32)}
    for index, (_, _, inputs, targets) in enumerate(documents):
        alone["input_ids"][index, :len(inputs)] = inputs
        alone["target_ids"][index, :len(inputs)] = targets
        alone["weights"][index, :len(inputs)] = 1.0
    alone = {k: jnp.asarray(v) for k, v in alone.items()}
    own_logits = logits_of(params, alone["input_ids"])
    for index, (row, start, inputs, _) in enumerate(documents):
        assert_close(logits[row, start:start + len(inputs)], own_logits[index, :len(inputs)],
                     what=f"logits of a document at row {row}, {start}")
    alone_grads = grad_sum(params, alone)
    assert_close(packed_grads, alone_grads, what="summed gradients of the packed batch")
    # Without segment ids the documents would see each other: the check can fail.
    crossing = logits_of(params, batch["input_ids"], None, batch["positions"])
    row, start, inputs, _ = documents[1]
    assert not np.allclose(crossing[row, start:start + len(inputs)],
                           logits[row, start:start + len(inputs)], atol=1e-3)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("tp_size", [2, 4])
def test_packed_rows_under_data_and_tensor_parallelism_match_one_device(name, tp_size):
    """The TP step averages the data shards' token means; so does the reference, on one
    device, over the same shards of the packed batch (loss and every gradient)."""
    model, params = _params(name)
    _, packed = _documents()
    batch = {k: jnp.asarray(v) for k, v in packed.items()}
    shards = 8 // tp_size
    rows = len(ROWS) // shards

    def mean_of_shard_means(p):
        return jnp.mean(jnp.stack([
            functional(model, None, p, ({k: v[i * rows:(i + 1) * rows] for k, v in
                                         batch.items()},), is_training=False)[0][0]
            for i in range(shards)]))

    loss, grads = jax.jit(jax.value_and_grad(mean_of_shard_means))(params)
    (tp_loss, tp_grads), _ = tensor_parallel_parity.tensor_parallel(model, params, batch,
                                                                    tp_size=tp_size)
    assert_close(tp_loss, loss, what="packed loss under DP x TP")
    assert_close(tp_grads, grads, what="packed gradients under DP x TP")
