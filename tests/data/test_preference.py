"""Preference pairs (data/preference.py): each pair's two rows, the completion's tokens marked
for scoring, the stated truncation rule, TRL's conversational form through a chat template, and
bad records named."""

import json

import numpy as np
import pytest

from titanax import errors
from titanax.data.preference import PreferencePairs
from titanax.data.tokenizer import Tokenizer


def _write(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return str(path)


def _source(files, **fields):
    return PreferencePairs.default_config().set(files=[files], held_out_fraction=0.0, seed=None,
                                                **fields).instantiate()


def _scored(example, side):
    """The targets a row scores, as text (bytes)."""
    weights = example[f"{side}_weights"].astype(bool)
    return bytes(example[f"{side}_target_ids"][weights].tolist()).decode()


def test_byte_pairs_are_prompt_then_completion_with_only_the_completion_scored(tmp_path):
    files = _write(tmp_path / "p.jsonl", [{"prompt": "2+3=", "chosen": "5", "rejected": "six"}])
    example = _source(files, seq_len=16)[0]
    for side, completion in (("chosen", "5"), ("rejected", "six")):
        text = "2+3=" + completion
        ids = example[f"{side}_input_ids"]
        # Bytes, no start or end token; inputs and targets shifted by one; padding after.
        assert bytes(ids[:len(text) - 1].tolist()).decode() == text[:-1]
        assert bytes(example[f"{side}_target_ids"][:len(text) - 1].tolist()).decode() == text[1:]
        assert _scored(example, side) == completion
        assert not example[f"{side}_weights"][len(text) - 1:].any()


def test_long_pairs_keep_the_prompts_end_and_the_completions_start(tmp_path, caplog):
    caplog.set_level("INFO", logger="titanax")
    prompt = "".join(chr(ord("a") + i % 26) for i in range(40))
    files = _write(tmp_path / "p.jsonl", [
        {"prompt": prompt, "chosen": "C" * 30, "rejected": "R" * 5},
        {"prompt": "short", "chosen": "x" * 12, "rejected": "y" * 40}])
    source = _source(files, seq_len=16)  # A row holds 17 tokens; half a row: 8.
    first, second = source[0], source[1]
    # The longer completion (30) leaves no room: the prompt keeps its last 8 tokens (half a
    # row), the completions their first 9 (17 - 8).
    kept = bytes(first["chosen_input_ids"][:8].tolist()).decode()
    assert kept == prompt[-8:]
    assert _scored(first, "chosen") == "C" * 9 and _scored(first, "rejected") == "R" * 5
    assert bytes(first["rejected_input_ids"][:8].tolist()).decode() == prompt[-8:]
    # A short prompt is kept whole; the long completion keeps its start.
    assert _scored(second, "rejected") == "y" * (17 - 5)
    assert source.report.truncated == 2
    # Said as a warning (at the start of a run), with how to keep the pairs whole.
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "2 truncated" in warned[0] and "seq_len" in warned[0], warned


def test_trl_conversational_pairs_score_the_assistant_tokens(tmp_path, chat_tokenizer):
    tokenizer = Tokenizer.default_config().set(path=chat_tokenizer).instantiate()
    user = {"role": "user", "content": "What is 2+2?"}
    files = _write(tmp_path / "c.jsonl", [
        {"chosen": [user, {"role": "assistant", "content": "Four."}],
         "rejected": [user, {"role": "assistant", "content": "Five, surely."}]},
        {"prompt": [user], "chosen": [{"role": "assistant", "content": "Four."}],
         "rejected": [{"role": "assistant", "content": "Five, surely."}]}])
    source = PreferencePairs.default_config().set(
        files=[files], held_out_fraction=0.0, seed=None, seq_len=64).instantiate(
            tokenizer=tokenizer)
    implicit, explicit = source[0], source[1]
    for name in implicit:  # A prompt inside the lists or apart: the same rows.
        np.testing.assert_array_equal(implicit[name], explicit[name])
    for side, answer in (("chosen", "Four."), ("rejected", "Five, surely.")):
        ids, trained = tokenizer.encode_conversation(
            (("user", "What is 2+2?"), ("assistant", answer)))
        scored = implicit[f"{side}_target_ids"][implicit[f"{side}_weights"].astype(bool)]
        np.testing.assert_array_equal(scored, ids[trained])


def test_bad_records_are_named_by_file_and_line(tmp_path):
    files = _write(tmp_path / "bad.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"},
                                            {"prompt": "a", "chosen": "b"}])
    with pytest.raises(errors.DataError, match=r"bad.jsonl:2.*no field 'rejected'"):
        _source(files)
    mixed = _write(tmp_path / "mixed.jsonl", [{"prompt": "a", "chosen": "b",
                                               "rejected": [{"role": "user", "content": "c"}]}])
    with pytest.raises(errors.DataError, match="both be text or both lists"):
        _source(mixed)


def test_a_multi_turn_pair_scores_only_its_final_answer(tmp_path, chat_tokenizer):
    """Earlier assistant turns are part of the prompt (TRL compares the final messages)."""
    tokenizer = Tokenizer.default_config().set(path=chat_tokenizer).instantiate()
    history = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": "What is 2+2?"}]
    files = _write(tmp_path / "m.jsonl", [
        {"chosen": history + [{"role": "assistant", "content": "Four."}],
         "rejected": history + [{"role": "assistant", "content": "Five."}]}])
    example = PreferencePairs.default_config().set(
        files=[files], held_out_fraction=0.0, seed=None, seq_len=64).instantiate(
            tokenizer=tokenizer)[0]
    ids, trained = tokenizer.encode_conversation(
        tuple((m["role"], m["content"]) for m in history) + (("assistant", "Four."),))
    last = ids[trained][-int(trained[::-1].argmin()):]  # The final assistant span's tokens.
    scored = example["chosen_target_ids"][example["chosen_weights"].astype(bool)]
    np.testing.assert_array_equal(scored, last)
    assert len(scored) < int(trained.sum())  # "Hello." is not scored.


USER = {"role": "user", "content": "What is 2 plus 3?"}


@pytest.mark.parametrize("record,said", [
    ({"prompt": "2+3=", "chosen": "5", "rejected": "5"}, "are the same: the pair prefers nothing"),
    ({"prompt": " ", "chosen": "5", "rejected": "6"}, "'prompt' is empty"),
    ({"chosen": [USER, {"role": "assistant", "content": "5"}, USER],
      "rejected": [USER, {"role": "assistant", "content": "6"}]}, "'chosen' ends with a user turn"),
    ({"chosen": [USER, {"role": "assistant", "content": "5"}],
      "rejected": [USER, {"role": "assistant", "content": "5"}]}, "are the same"),
], ids=["same text", "empty prompt", "ends with the user", "same messages"])
def test_a_pair_that_prefers_nothing_is_refused_naming_its_line(tmp_path, record, said):
    files = _write(tmp_path / "p.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "3"},
                                          record])
    with pytest.raises(errors.DataError) as info:
        _source(files, seq_len=32)
    assert "p.jsonl:2" in str(info.value) and said in str(info.value), str(info.value)


def test_pairs_that_differ_only_past_the_row_are_refused_naming_seq_len(tmp_path):
    """A long shared answer start: cut to 16 tokens, chosen and rejected rows are the same."""
    files = _write(tmp_path / "p.jsonl", [
        {"prompt": "Q:", "chosen": "the answer is, after long thought, yes",
         "rejected": "the answer is, after long thought, no"}])
    with pytest.raises(errors.DataError) as info:
        _source(files, seq_len=16)
    assert info.value.path == "seq_len" and "p.jsonl:1" in info.value.message
    assert len(_source(files, seq_len=64)) == 1  # (Rows long enough: the pair is kept.)
