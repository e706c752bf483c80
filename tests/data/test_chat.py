"""Chat records: rendered by the tokenizer's template, trained on the assistant's turns only --
against transformers' apply_chat_template and its assistant mask."""

import json

import numpy as np
import pytest

from titanax import errors
from titanax.data.packed import PackedDocuments
from titanax.data.tokenizer import Tokenizer
from tests.data.conftest import MARKED  # (The chat_tokenizer fixture's template.)

UNMARKED = MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")

CONVERSATIONS = [
    [("system", "You are terse."), ("user", "What is 2+2?"), ("assistant", "Four, my lord."),
     ("user", "And <|im_end|> 3+3?"), ("assistant", "Six.")],
    [("user", "Speak the speech, I pray you."), ("assistant", "As you pronounced it to me, "
                                                               "trippingly on the tongue.")],
]


@pytest.mark.parametrize("template", ["marked", "turn by turn"])
@pytest.mark.parametrize("conversation", [0, 1])
def test_ids_and_assistant_mask_match_transformers(chat_tokenizer, template, conversation):
    """The marked template is read through its {% generation %} blocks; the same template
    without them, turn by turn: both give transformers' ids and assistant mask."""
    from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
    messages = CONVERSATIONS[conversation]
    hf = AutoTokenizer.from_pretrained(chat_tokenizer).apply_chat_template(
        [{"role": r, "content": c} for r, c in messages], tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True)
    assert sum(hf["assistant_masks"]) > 0
    ours = Tokenizer.default_config().set(
        path=chat_tokenizer, chat_template=None if template == "marked" else UNMARKED
    ).instantiate()
    ids, trained = ours.encode_conversation(messages)
    assert ids.tolist() == hf["input_ids"]
    assert trained.astype(int).tolist() == hf["assistant_masks"]


@pytest.mark.parametrize("template", ["marked", "turn by turn"])
@pytest.mark.parametrize("turns", [1, 4])
def test_a_chat_prompt_is_transformers_apply_chat_template_with_the_generation_prompt(
        chat_tokenizer, template, turns):
    """What ``generate --chat`` feeds the model: the template rendered with the generation
    prompt (a {% generation %} block as its plain text), special tokens in the text read as
    such (the user's literal "<|im_end|>" too), as transformers encodes it."""
    from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
    messages = CONVERSATIONS[0][:turns]
    assert messages[-1][0] in ("system", "user")
    source = MARKED if template == "marked" else UNMARKED
    reference = AutoTokenizer.from_pretrained(chat_tokenizer)
    hf = reference.apply_chat_template(
        [{"role": r, "content": c} for r, c in messages], chat_template=source, tokenize=True,
        add_generation_prompt=True, return_dict=True)["input_ids"]
    ours = Tokenizer.default_config().set(path=chat_tokenizer, chat_template=source).instantiate()
    assert ours.encode_chat_prompt(messages) == hf
    assert ours.chat_end_ids() == [reference.convert_tokens_to_ids("<|im_end|>")]


def _jsonl(path, conversations):
    with open(path, "w", encoding="utf-8") as f:
        for messages in conversations:
            f.write(json.dumps({"messages": [{"role": r, "content": c}
                                             for r, c in messages]}) + "\n")
    return str(path)


def _chat_source(files, **changes):
    return PackedDocuments.default_config().set(files=list(files), format="chat",
                                                held_out_fraction=0.0, seq_len=256, seed=None,
                                                **changes)


def test_packed_chat_rows_train_on_exactly_the_assistants_text(tmp_path):
    """Bytes and the default template: the trained targets of each packed conversation spell
    its assistant turns (each with its turn's end), and nothing else."""
    conversations = CONVERSATIONS * 3
    source = _chat_source([_jsonl(tmp_path / "chat.jsonl", conversations)]).instantiate()
    trained_text = []
    for index in range(len(source)):
        row = source[index]
        for segment in range(1, row["segment_ids"].max() + 1):
            at = row["segment_ids"] == segment
            targets, weights = row["target_ids"][at], row["weights"][at]
            trained_text.append(bytes(targets[weights > 0].astype(np.uint8).tolist()).decode())
    want = ["".join(f"{c}\n\n" for r, c in messages if r == "assistant")
            for messages in conversations]
    assert trained_text == want
    assert source.report.trained_tokens == sum(len(t.encode()) for t in want)


def test_conversations_the_template_cannot_split_are_named_or_skipped(tmp_path):
    # Each rendering restates the turn count first: no rendering extends the one before.
    rewriting = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    files = [_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)]
    tokenizer = Tokenizer.default_config().set(chat_template=rewriting).instantiate()
    with pytest.raises(errors.DataError, match="other than a continuation") as e:
        _chat_source(files).instantiate(tokenizer=tokenizer)
    assert e.value.path.endswith("chat.jsonl:1")
    refusing = "{{ raise_exception('roles must alternate') }}"
    tokenizer = Tokenizer.default_config().set(chat_template=refusing).instantiate()
    with pytest.raises(errors.DataError, match="roles must alternate"):
        _chat_source(files).instantiate(tokenizer=tokenizer)
    mixed = _jsonl(tmp_path / "mixed.jsonl", CONVERSATIONS + [[("user", "u"), ("user", "v")]])
    good = _jsonl(tmp_path / "good.jsonl", CONVERSATIONS)
    with pytest.raises(errors.DataError, match="no assistant message") as e:
        _chat_source([mixed]).instantiate()
    assert e.value.path.endswith("mixed.jsonl:3")
    skipping = _chat_source([mixed], on_bad_record="skip").instantiate()
    assert skipping.read_report.skipped == 1
    assert np.array_equal(skipping.rows["weights"],
                          _chat_source([good]).instantiate().rows["weights"])
    broken = Tokenizer.default_config().set(chat_template="{% for %}").instantiate()
    with pytest.raises(errors.DataError, match="does not compile") as e:
        _chat_source(files).instantiate(tokenizer=broken)
    assert e.value.path == "tokenizer.chat_template"
    bad_role = _jsonl(tmp_path / "role.jsonl", [[("narrator", "x"), ("assistant", "y")]])
    with pytest.raises(errors.DataError, match="role 'narrator'"):
        _chat_source([bad_role]).instantiate()
