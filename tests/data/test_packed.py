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
    with pytest.raises(errors.DataError, match="records come from JSONL or Parquet files"):
        _source([str(text)], format="prompt_completion")


def test_a_padded_last_batch_keeps_the_rows_token_masks(tmp_path):
    """last_batch="pad" multiplies the source's per-token weights by the row weights (it used
    to replace them: prompt and padding tokens were then trained on)."""
    from titanax.data.pipeline import Input
    records = [{"prompt": "abcd", "completion": "efgh"} for _ in range(3)]
    source = _source([_jsonl(tmp_path / "p.jsonl", records)], seq_len=16, pack=False,
                     format="prompt_completion", seed=None)
    made = Input(Input.default_config().set(global_batch_size=2, shuffle=False, num_epochs=1,
                                            last_batch="pad"), source=source)
    batches = list(made)
    assert [b["weights"].shape for b in batches] == [(2, 16), (2, 16)]
    assert np.array_equal(batches[0]["weights"][0], source[0]["weights"])
    assert np.array_equal(batches[1]["weights"][1], np.zeros(16))  # The padding row.
    assert batches[0]["weights"][0][:3].sum() == 0  # The prompt's targets stay untrained.


def test_undecodable_lines_and_globs_that_match_nothing_are_named(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(errors.DataError, match="not UTF-8") as e:
        _source([str(path)])
    assert e.value.path.endswith("mixed.jsonl:2")
    assert _source([str(path)], on_bad_record="skip").read_report.skipped == 1
    with pytest.raises(errors.DataError, match="no files match .*typo"):
        _source([str(path), str(tmp_path / "typo" / "*.jsonl")])


def test_a_tokenizer_path_on_a_source_that_does_not_tokenize_is_refused(tmp_path):
    from titanax.data.pipeline import Input
    from titanax.data.sources import MNIST
    cfg = Input.default_config().set(source=MNIST.default_config(), global_batch_size=8)
    cfg.tokenizer.path = str(tmp_path)
    with pytest.raises(errors.DataError, match="does not tokenize text") as e:
        cfg.instantiate()
    assert e.value.path == "tokenizer.path"


def test_text_windows_read_with_the_inputs_tokenizer(tmp_path):
    """The plain-text windows (gpt / llama_tiny_dp_tp's input) are the tokenizer's ids, not
    bytes, when the input names one."""
    from titanax.data import train_tokenizer
    from titanax.data.pipeline import Input
    from titanax.data.sources import TextWindows
    text = tmp_path / "corpus.txt"
    text.write_text("to be or not to be, that is the question. " * 200)
    train_tokenizer.train([str(text)], vocab_size=300, out=str(tmp_path / "tok"),
                          progress=False)
    cfg = Input.default_config().set(
        source=TextWindows.default_config().set(files=[str(text)], seq_len=16,
                                                held_out_fraction=0.0),
        global_batch_size=8, shuffle=False)
    cfg.tokenizer.path = str(tmp_path / "tok")
    made = cfg.instantiate()
    tokenizer = made.source.tokenizer
    window = made.source[0]
    assert 256 < tokenizer.vocab_size <= 300 and window["input_ids"].max() >= 256  # Merges.
    assert tokenizer.decode(list(window["input_ids"]) + [int(window["target_ids"][-1])]) in \
        text.read_text()
    np.testing.assert_array_equal(window["target_ids"][:-1], window["input_ids"][1:])


def test_prompt_completion_without_files_and_an_odd_head_width_are_refused():
    with pytest.raises(errors.DataError, match="come from your files") as e:
        PackedDocuments.default_config().set(format="prompt_completion").instantiate()
    assert e.value.path == "files"
    cfg = Decoder.default_config().set(name="m", model_dim=28, num_heads=4)  # Heads of 7.
    with pytest.raises(errors.ConfigValidationError, match="model_dim.*width 7"):
        cfg.validate()


def test_long_pairs_keep_their_completion_when_truncated_or_are_dropped(tmp_path, caplog):
    """Prompts of 60 bytes before completions of 10, rows of 32: "truncate" keeps each whole
    completion after the end of its prompt; "drop" leaves the long ones out; both counted, in a
    warning (at the start of a run)."""
    caplog.set_level("INFO", logger="titanax")
    records = [{"prompt": f"{i:02d}" + "p" * 58, "completion": f" answer {i:02d}"}
               for i in range(6)] + [{"prompt": "short?", "completion": " yes"}]
    files = [_jsonl(tmp_path / "long.jsonl", records)]
    truncated = _source(files, format="prompt_completion", seq_len=32, pack=False, seed=None,
                        long_documents="truncate")
    assert truncated.report.truncated_documents == 6
    assert truncated.report.truncated_tokens == 6 * (70 - 1 - 32)
    for index, record in enumerate(records):
        row = truncated[index]
        at = row["segment_ids"] > 0
        text = bytes(np.append(row["input_ids"][at], row["target_ids"][at][-1])
                     .astype(np.uint8).tolist()).decode()
        trained = bytes(row["target_ids"][row["weights"] > 0].astype(np.uint8).tolist()).decode()
        assert trained == record["completion"]
        assert text == (record["prompt"] + record["completion"])[-33:]
    dropped = _source(files, format="prompt_completion", seq_len=32, pack=False,
                      long_documents="drop")
    assert dropped.report.dropped_documents == 6 and len(dropped) == 1
    assert "6 longer than a row left out" in dropped.report.text()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2 and "6 longer than a row truncated" in warned[0] and \
        "6 longer than a row left out" in warned[1], warned
    # Rows that hold their documents whole: information, no warning.
    caplog.clear()
    _source(files, format="prompt_completion", seq_len=128, pack=False)
    assert [r.levelname for r in caplog.records if "split:" in r.getMessage()] == ["INFO"]
