"""The offline BPE trainer and the tokenizer config: round trips, transformers agrees, errors."""

import os

import numpy as np
import pytest

from tests import forked_python
from tests.environment import child_environment
from titanax import errors
from titanax.data import train_tokenizer
from titanax.data.tokenizer import Tokenizer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bundled():
    """A 1024-token BPE trained on the bundled plays, through the command itself."""
    paths = train_tokenizer.corpus_files()
    texts = [open(p, encoding="utf-8").read() for p in paths]
    return paths, texts


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tok") / "shakespeare")
    result = forked_python.run(["-m", "titanax.data.train_tokenizer",
                                "--vocab_size=1024", f"--out={out}"], cwd=REPO_ROOT,
                               env=child_environment(), timeout=300)
    assert result.returncode == 0, result.stderr
    assert "trained a 1024-token BPE on 38 file(s)" in result.stdout
    return out


def test_every_play_round_trips_and_subwords_compress_it(trained, bundled):
    _, texts = bundled
    tokenizer = Tokenizer.default_config().set(path=trained).instantiate()
    assert tokenizer.vocab_size == 1024
    ids = tokenizer.encode_batch(texts)
    for text, encoded in zip(texts, ids):
        assert tokenizer.decode(encoded) == text
        assert encoded.min() >= 0 and encoded.max() < 1024
    total_bytes = sum(len(t.encode("utf-8")) for t in texts)
    total_tokens = sum(len(e) for e in ids)
    # Bytes per token: 1 for bytes; measured 2.34 at 1024 tokens on the plays.
    assert total_bytes / total_tokens > 2.0, total_bytes / total_tokens
    odd = "naïve café — 日本語 \t\n emoji 🎭"
    assert tokenizer.decode(tokenizer.encode(odd)) == odd  # Byte-level: anything round-trips.


def test_transformers_loads_it_and_encodes_identically(trained, bundled):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    _, texts = bundled
    ours = Tokenizer.default_config().set(path=os.path.join(trained, "tokenizer.json")
                                          ).instantiate()
    fast = PreTrainedTokenizerFast(tokenizer_file=os.path.join(trained, "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(trained)
    for text in texts[:5]:
        expected = ours.encode(text).tolist()
        assert fast.encode(text, add_special_tokens=False) == expected
        assert auto.encode(text, add_special_tokens=False) == expected
    assert ours.bos_id == ours.eos_id == auto.eos_token_id == fast.convert_tokens_to_ids(
        train_tokenizer.END_OF_TEXT)
    # Its chat template ships with it: transformers renders a conversation to our ids.
    messages = [("user", "Who is there?"), ("assistant", "Nay, answer me.")]
    ids, _ = Tokenizer.default_config().set(path=trained).instantiate().encode_conversation(
        messages)
    assert auto.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                    tokenize=True, return_dict=True)["input_ids"] == ids.tolist()


def test_no_path_is_the_byte_tokenizer():
    tokenizer = Tokenizer.default_config().instantiate()
    assert tokenizer.vocab_size == 256 and tokenizer.eos_id is None
    assert np.array_equal(tokenizer.encode("AB"), [65, 66]) and tokenizer.decode([65, 66]) == "AB"


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(errors.DataError, match="no such file") as e:
        Tokenizer.default_config().set(path=str(tmp_path / "nope.json")).instantiate()
    assert e.value.path.startswith("tokenizer.path")
    with pytest.raises(errors.DataError, match="has no tokenizer.json"):
        Tokenizer.default_config().set(path=str(tmp_path)).instantiate()
    with pytest.raises(errors.DataError, match="no files match"):
        train_tokenizer.corpus_files([str(tmp_path / "*.txt")])
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(errors.DataError, match="min_frequency must be >= 1"):
        train_tokenizer.train([str(tmp_path / "a.txt")], vocab_size=300, min_frequency=0,
                              out=str(tmp_path / "o0"))
    with pytest.raises(errors.DataError, match="below the 256 bytes"):
        train_tokenizer.train([str(tmp_path / "a.txt")], vocab_size=100, out=str(tmp_path / "o"))
    with pytest.raises(errors.DataError, match="not an empty directory"):
        train_tokenizer.train([str(tmp_path / "a.txt")], vocab_size=300, out=str(tmp_path))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(errors.DataError, match="not UTF-8") as e:
        train_tokenizer.train([str(tmp_path / "latin1.txt")], vocab_size=300,
                              out=str(tmp_path / "o2"), progress=False)
    assert e.value.path.endswith("latin1.txt")


def test_special_tokens_written_in_text_are_text_and_configs_are_checked(trained, tmp_path):
    tokenizer = Tokenizer.default_config().set(path=trained).instantiate()
    boundary = tokenizer.eos_id
    assert boundary not in tokenizer.encode("a <|endoftext|> b").tolist()
    # A bare tokenizer.json takes its one boundary token as BOS and EOS.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text(open(os.path.join(trained, "tokenizer.json")).read())
    assert Tokenizer.default_config().set(path=str(bare)).instantiate().bos_id == boundary
    # add_bos_token false, and "" to switch one off.
    (bare / "tokenizer_config.json").write_text(
        '{"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "add_bos_token": false}')
    no_bos = Tokenizer.default_config().set(path=str(bare)).instantiate()
    assert no_bos.bos_id is None and no_bos.eos_id == boundary
    assert Tokenizer.default_config().set(path=str(bare), eos_token="").instantiate(
        ).eos_id is None
    (bare / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(errors.DataError, match="cannot read it") as e:
        Tokenizer.default_config().set(path=str(bare)).instantiate()
    assert e.value.path.endswith("tokenizer_config.json")


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory, bundled):
    """A 600-piece SentencePiece BPE (byte fallback) trained here on two plays, saved as a
    Hugging Face directory holds one: tokenizer.model beside tokenizer_config.json."""
    import sentencepiece  # pylint: disable=import-outside-toplevel
    out = tmp_path_factory.mktemp("spm")
    _, texts = bundled
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter("\n".join(texts[:2]).splitlines()),
        model_prefix=str(out / "tokenizer"), vocab_size=600, model_type="bpe", unk_id=0,
        bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True, minloglevel=2,
        # Llama's settings: text kept as it is (newlines included), digits one by one.
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True)
    (out / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", '
        '"add_bos_token": true, "add_eos_token": false, "legacy": false}')
    return str(out)


def test_a_sentencepiece_model_encodes_as_transformers_does(sentencepiece_dir, bundled):
    from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
    _, texts = bundled
    ours = Tokenizer.default_config().set(path=sentencepiece_dir).instantiate()
    assert ours.file.endswith("tokenizer.model") and ours.vocab_size == 600
    assert (ours.bos_id, ours.eos_id) == (1, 2)
    theirs = AutoTokenizer.from_pretrained(sentencepiece_dir)
    for text in [texts[2][:5000], "naïve café — 日本語 🎭\n\n  x 1234"]:
        ids = ours.encode(text)
        assert ids.tolist() == theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == text
    # A document's "</s>" is text (transformers would read it as the EOS token).
    written = "a </s> in the text stays text"
    assert 2 not in ours.encode(written).tolist() and ours.decode(ours.encode(written)) == written
    # The model file alone: its own BOS / EOS pieces.
    alone = Tokenizer.default_config().set(
        path=os.path.join(sentencepiece_dir, "tokenizer.model")).instantiate()
    assert (alone.token(alone.bos_id), alone.token(alone.eos_id)) == ("<s>", "</s>")
    # A directory that ships no chat template renders no conversation unless one is named (a
    # format of our own would be one its tokenizer cannot render at inference)...
    with pytest.raises(errors.DataError, match="ships no chat template") as refused:
        ours.encode_conversation([("user", "Hi"), ("assistant", "Hail.")])
    assert refused.value.path == "tokenizer.chat_template"
    # ... "plain" names the "### <role>" one: its BOS and the assistant's EOS read as tokens.
    plain = Tokenizer.default_config().set(path=sentencepiece_dir,
                                           chat_template="plain").instantiate()
    ids, trained = plain.encode_conversation([("user", "Hi"), ("assistant", "Hail.")])
    assert ids[0] == 1 and not trained[0] and 2 in ids[trained].tolist()


def test_a_sentencepiece_conversation_encodes_as_transformers_does(sentencepiece_dir):
    """A conversation rendered by the "plain" template and encoded turn by turn: the ids of
    transformers' apply_chat_template (no word-start mark after a special token or at a turn's
    start, where encoding each piece alone would add one)."""
    from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
    from titanax.data.chat import DEFAULT_TEMPLATE  # pylint: disable=import-outside-toplevel
    messages = [("system", "Be brief."), ("user", "Who is there?"), ("assistant", "Nay, answer "
                "me."), ("user", "Long live the king!"), ("assistant", "Barnardo?")]
    ours = Tokenizer.default_config().set(path=sentencepiece_dir,
                                          chat_template="plain").instantiate()
    ids, trained = ours.encode_conversation(messages)
    theirs = AutoTokenizer.from_pretrained(sentencepiece_dir).apply_chat_template(
        [{"role": r, "content": c} for r, c in messages], chat_template=DEFAULT_TEMPLATE,
        tokenize=True, return_dict=True)["input_ids"]
    assert ids.tolist() == theirs
    assert ours.decode(ids[trained]).replace("</s>", "") == "Nay, answer me.\n\nBarnardo?\n\n"
