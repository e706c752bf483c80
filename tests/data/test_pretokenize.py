"""Pre-tokenized rows (ArrayRecord) read back exactly as packed, and checked against the input."""

import json

import numpy as np
import pytest

from tests import forked_python
from tests.environment import child_environment
from titanax import errors
from titanax.data.packed import PackedDocuments
from titanax.data.pretokenize import PackedRows, write_rows
from titanax.data.tokenizer import Tokenizer
from titanax.modules.models.decoder import Decoder
from tests.data.test_tokenizer import REPO_ROOT


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(300):
            f.write(json.dumps({"text": f"doc {i} " + "abc " * (i % 30)}) + "\n")
    return str(path)


def test_the_command_writes_rows_that_read_back_exactly(jsonl, tmp_path):
    out = str(tmp_path / "rows")
    result = forked_python.run(["-m", "titanax.data.pretokenize",
                                f"--files={jsonl}", f"--out={out}", "--seq_len=32",
                                "--rows_per_shard=40"], cwd=REPO_ROOT, env=child_environment(),
                               timeout=300)
    assert result.returncode == 0, result.stderr
    rows = PackedRows.default_config().set(path=out).instantiate()
    packed = PackedDocuments.default_config().set(files=[jsonl], seq_len=32,
                                                  held_out_fraction=0.0).instantiate()
    assert len(rows) == len(packed) > 40  # Several shards.
    for index in range(len(rows)):
        for name, value in packed[index].items():
            assert rows[index][name].dtype == value.dtype
            assert np.array_equal(rows[index][name], value), (index, name)


def test_rows_of_another_vocabulary_or_length_are_refused(jsonl, tmp_path):
    out = str(tmp_path / "rows")
    write_rows(PackedDocuments.default_config().set(files=[jsonl], seq_len=16,
                                                    held_out_fraction=0.0).instantiate(),
               out, progress=False)
    with pytest.raises(errors.DataError, match="hold 16 tokens, not 32"):
        PackedRows.default_config().set(path=out, seq_len=32).instantiate()
    from tokenizers import Tokenizer as HFTokenizer, models
    tokenizer_json = tmp_path / "tokenizer.json"
    HFTokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(
        str(tokenizer_json))
    other = Tokenizer.default_config().set(path=str(tokenizer_json)).instantiate()
    with pytest.raises(errors.DataError, match="another tokenizer \\(bytes, 256 tokens\\)"):
        PackedRows.default_config().set(path=out).instantiate(tokenizer=other)
    with pytest.raises(errors.DataError, match="no pre-tokenized rows"):
        PackedRows.default_config().set(path=str(tmp_path)).instantiate()
    with pytest.raises(errors.DataError, match="not an empty directory"):
        write_rows(PackedDocuments.default_config().set(files=[jsonl]).instantiate(), out,
                   progress=False)


def test_rows_of_another_tokenizer_with_the_same_vocabulary_size_are_refused(jsonl, tmp_path):
    from titanax.data.train_tokenizer import corpus_files, train
    plays = corpus_files()
    halves = plays[:3], plays[-3:]  # Two BPEs of one size, trained on other plays.
    paths = [train(half, vocab_size=400, out=str(tmp_path / f"tok{i}"), progress=False)
             for i, half in enumerate(halves)]
    first, second = (Tokenizer.default_config().set(path=p).instantiate() for p in paths)
    assert first.vocab_size == second.vocab_size
    out = str(tmp_path / "rows")
    write_rows(PackedDocuments.default_config().set(files=[jsonl], seq_len=16,
                                                    held_out_fraction=0.0).instantiate(
        tokenizer=first), out, progress=False)
    PackedRows.default_config().set(path=out).instantiate(tokenizer=first)
    with pytest.raises(errors.DataError, match="tokenizer_sha256"):
        PackedRows.default_config().set(path=out).instantiate(tokenizer=second)


def test_the_largest_id_written_is_declared_and_checked_against_the_model(jsonl, tmp_path):
    """rows.json records the largest id; a model that does not cover it is refused before any
    row is read (the ids of bytes text here: up to 'c' = 99)."""
    from titanax.data.pipeline import Input
    from titanax.modules.input_limits import InputLimit
    from titanax.train.engine import Engine
    from titanax.train.inputs import check_declarations
    out = str(tmp_path / "rows")
    packed = PackedDocuments.default_config().set(files=[jsonl], seq_len=32,
                                                  held_out_fraction=0.0).instantiate()
    write_rows(packed, out, progress=False)
    largest = max(int(max(packed[i]["input_ids"].max(), packed[i]["target_ids"].max()))
                  for i in range(len(packed)))
    with open(f"{out}/rows.json", encoding="utf-8") as f:
        assert json.load(f)["max_id"] == largest
    config = Engine.default_config().set(train_input=Input.default_config().set(
        source=PackedRows.default_config().set(path=out), global_batch_size=8))

    def limits(num_ids, length=64):
        limit = InputLimit(num_ids=num_ids, num_ids_field="vocab_size", max_length=length,
                           max_length_field="max_seq_len")
        return {"input_ids": limit, "target_ids": limit}

    check_declarations(config, limits(largest + 1))  # Covered: fine.
    with pytest.raises(errors.DataError) as info:
        check_declarations(config, limits(largest))
    assert info.value.path == "model.vocab_size"
    assert f"largest id {largest}" in info.value.message
    with pytest.raises(errors.DataError) as info:
        check_declarations(config, limits(256, length=16))
    assert info.value.path == "model.max_seq_len" and "rows of 32 positions" in info.value.message
    # A model left without a vocabulary takes the tokenizer's the rows were written with (bytes:
    # 256), not the largest id they happen to hold.
    from titanax.train.inputs import vocab_from_train_input
    unsized = config.clone().set(model=Decoder.default_config().set(vocab_size=None))
    assert vocab_from_train_input(unsized).model.vocab_size == 256 > largest + 1
