"""Documents from JSONL / text files, tokenized and packed into rows; SFT masks; bad records."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.numerics import assert_close
from titanax import errors
from titanax.data.packed import PackedDocuments
from titanax.modules import functional
from titanax.modules.models.decoder import Decoder


def _jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


def _source(files, **changes):
    return PackedDocuments.default_config().set(files=list(files), held_out_fraction=0.0,
                                                **changes).instantiate()


def test_rows_hold_every_document_once_with_its_segments_and_positions(tmp_path):
    texts = [f"document number {i} " * (i % 5 + 1) for i in range(40)]
    source = _source([_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])], seq_len=48)
    rebuilt = []
    for index in range(len(source)):
        row = source[index]
        for segment in range(1, row["segment_ids"].max() + 1):
            at = row["segment_ids"] == segment
            assert np.array_equal(row["positions"][at], np.arange(at.sum()))
            assert np.array_equal(row["input_ids"][at][1:], row["target_ids"][at][:-1])
            rebuilt.append(bytes(np.append(row["input_ids"][at],
                                           row["target_ids"][at][-1]).astype(np.uint8)).decode())
        assert not row["weights"][row["segment_ids"] == 0].any()  # Padding is never trained.
    short = [t for t in texts if len(t) - 1 <= 48]  # Pairs of a document: its length - 1.
    assert all(rebuilt.count(t) == texts.count(t) for t in short)
    assert source.report.trained_tokens == sum(len(t) - 1 for t in texts)
    assert source.report.split_documents == len(texts) - len(short) > 0
    chunks = sum(-(-(len(t) - 1) // 48) for t in texts)
    assert len(_source([str(tmp_path / "a.jsonl")], seq_len=48, pack=False)) == chunks
    assert len(source) < chunks  # Packed: several documents (chunks) per row.


def test_a_prompt_completion_loss_is_the_mean_over_completion_tokens(tmp_path):
    """Packed rows of pairs against an independent computation: each record alone through the
    model, log-probabilities of its completion bytes only, averaged over every completion."""
    records = [{"prompt": f"Q{i}: {i * 7}?", "completion": f" A{i * 3}"} for i in range(12)]
    source = _source([_jsonl(tmp_path / "sft.jsonl", records)], seq_len=32,
                     format="prompt_completion", seed=None)
    model = Decoder.default_config().set(name="m", vocab_size=256, max_seq_len=32, num_layers=2,
                                         model_dim=32, num_heads=4, num_kv_heads=2,
                                         hidden_dim=48).instantiate()
    params = jax.jit(model.initialize_parameters_recursively)(jax.random.PRNGKey(0))
    batch = {k: jnp.asarray(np.stack([source[i][k] for i in range(len(source))]))
             for k in source[0]}
    (loss, aux), _ = functional(model, None, params, (batch,), is_training=False)
    log_probs, count = [], 0
    for record in records:
        text = (record["prompt"] + record["completion"]).encode()
        ids = jnp.asarray(np.frombuffer(text, np.uint8).astype(np.int32))[None]
        logits, _ = functional(model, None, params, (ids[:, :-1],), method="logits",
                               is_training=False)
        chosen = jax.nn.log_softmax(logits[0])
        start = len(record["prompt"].encode())  # First completion byte's index in ``text``.
        for j in range(start, len(text)):
            log_probs.append(float(chosen[j - 1, text[j]]))
        count += len(text) - start
    assert float(aux["num_tokens"]) == count
    assert_close(loss, -np.mean(log_probs), what="the loss over completion tokens")


def test_bad_records_are_named_or_skipped_and_counted(tmp_path):
    bad = _jsonl(tmp_path / "bad.jsonl", [{"text": "good one"}, "{not json", {"txt": "x"},
                                          {"text": "fine too"}])
    with pytest.raises(errors.DataError, match="bad record") as e:
        _source([bad])
    assert e.value.path.endswith("bad.jsonl:2")
    skipping = _source([bad], on_bad_record="skip")
    assert skipping.read_report.skipped == 2 and skipping.report.documents == 2
    with pytest.raises(errors.DataError, match="no text field 'text' \\(fields: txt\\)") as e:
        _source([_jsonl(tmp_path / "field.jsonl", [{"txt": "x"}])])
    assert e.value.path.endswith("field.jsonl:1")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    mixed = _source([bad, str(empty)], on_bad_record="skip")
    assert mixed.read_report.empty_files == 1
    with pytest.raises(errors.DataError, match="hold no document"):
        _source([str(empty)])
    with pytest.raises(errors.DataError, match="no files match"):
        _source([str(tmp_path / "none*.jsonl")])
    text = tmp_path / "plain.txt"
    text.write_text("one\n\ntwo")
    with pytest.raises(errors.DataError, match="needs JSONL records"):
        _source([str(text)], format="prompt_completion")
