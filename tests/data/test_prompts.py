"""Prompts for RL: text or conversational records, left-padded, their other fields kept for the
rewards, long prompts keeping their end, bad records named by file:line."""

import json

import numpy as np
import pytest

from titanax import errors
from titanax.data.prompts import Prompts
from titanax.data.tokenizer import Tokenizer


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_text_prompts_left_padded_with_their_fields(tmp_path):
    files = _write(tmp_path / "p.jsonl", [{"prompt": "ab", "answer": "1", "level": 2},
                                          {"prompt": "abcdef", "answer": "2"}])
    source = Prompts.default_config().set(files=[files], max_prompt_tokens=4,
                                          seed=None).instantiate()
    assert len(source) == 2
    first, second = source[0], source[1]
    np.testing.assert_array_equal(first["prompt_ids"], [0, 0, ord("a"), ord("b")])
    assert int(first["prompt_lengths"]) == 2
    np.testing.assert_array_equal(second["prompt_ids"], [ord(c) for c in "cdef"])
    assert source.truncated == 1
    assert source.fields_of(0) == {"answer": "1", "level": 2}
    assert source.prompt_of(1) == "abcdef"
    assert source.end_ids() == []  # (Bytes have no end token.)


def test_conversational_prompts_go_through_the_chat_template(tmp_path):
    files = _write(tmp_path / "c.jsonl", [
        {"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}])
    source = Prompts.default_config().set(files=[files], max_prompt_tokens=64).instantiate()
    tok = Tokenizer.default_config().instantiate()
    want = tok.encode_chat_prompt((("user", "hi"),))
    row = source[0]
    assert row["prompt_ids"][-int(row["prompt_lengths"]):].tolist() == want
    assert source.prompt_of(0) == [{"role": "user", "content": "hi"}]


def test_a_bad_record_is_named(tmp_path):
    files = _write(tmp_path / "b.jsonl", [{"prompt": "ok"}, {"question": "no prompt"}])
    with pytest.raises(errors.DataError, match="b.jsonl:2"):
        Prompts.default_config().set(files=[files]).instantiate()
    skipped = Prompts.default_config().set(files=[files], on_bad_record="skip").instantiate()
    assert len(skipped) == 1


def test_cut_prompts_are_warned_and_cut_chat_prompts_refused_unless_allowed(tmp_path, caplog):
    """A text prompt past max_prompt_tokens keeps its end, counted in a warning at start; a
    chat-rendered one would lose the template's start: refused by name, unless
    cut_long_chat_prompts keeps its end too."""
    texts = _write(tmp_path / "t.jsonl", [{"prompt": "ab"}, {"prompt": "abcdefgh"},
                                          {"prompt": "abcdef"}])
    with caplog.at_level("WARNING", logger="titanax"):
        source = Prompts.default_config().set(files=[texts], max_prompt_tokens=4,
                                              seed=None).instantiate()
    assert source.truncated == 2
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("2 of the train split's 3 prompts are longer than max_prompt_tokens=4 (the "
               "longest 8 tokens)" in m for m in warned), warned
    chats = _write(tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]},
                                          {"prompt": [{"role": "user", "content": "x" * 40}]}])
    cfg = Prompts.default_config().set(files=[chats], max_prompt_tokens=32, seed=None)
    with pytest.raises(errors.DataError) as info:
        cfg.instantiate()
    assert info.value.path == "max_prompt_tokens" and "c.jsonl:2" in info.value.message
    assert "cut_long_chat_prompts=true" in info.value.suggestion
    kept = cfg.clone(cut_long_chat_prompts=True).instantiate()
    assert kept.truncated == 1 and int(kept.lengths[1]) == 32
