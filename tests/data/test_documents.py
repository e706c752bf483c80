"""Document files: Parquet records read like their JSONL twins; bad rows named by file:row;
mixtures drawing each source's share."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from titanax import errors
from titanax.data.packed import PackedDocuments

RECORDS = {
    "text": [{"text": f"Document {i}: " + "word " * (i % 7)} for i in range(30)],
    "prompt_completion": [{"prompt": f"Q{i}?", "completion": f" A{i * 3}."} for i in range(30)],
    "chat": [{"messages": [{"role": "user", "content": f"Q{i}?"},
                           {"role": "assistant", "content": f"A{i}."}]} for i in range(30)],
}


def _jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return str(path)


def _parquet(path, records, *, row_group_size=7):
    pq.write_table(pa.Table.from_pylist(records), str(path), row_group_size=row_group_size)
    return str(path)


def _source(files, **changes):
    return PackedDocuments.default_config().set(files=list(files), held_out_fraction=0.0,
                                                seq_len=32, **changes).instantiate()


@pytest.mark.parametrize("kind", sorted(RECORDS))
def test_parquet_rows_equal_their_jsonl_twins(tmp_path, kind):
    """Read in row groups of 7, with an extra column; the same rows as the JSONL file."""
    records = RECORDS[kind]
    parquet = _parquet(tmp_path / "docs.parquet", [dict(r, extra=1) for r in records])
    from_parquet = _source([parquet], format=kind)
    from_jsonl = _source([_jsonl(tmp_path / "docs.jsonl", records)], format=kind)
    assert from_parquet.read_report.documents == len(records)
    for name, values in from_jsonl.rows.items():
        assert np.array_equal(from_parquet.rows[name], values), name
    assert from_parquet.report.trained_tokens > 0


def test_bad_parquet_rows_and_files_are_named(tmp_path):
    records = [{"text": "good"}, {"text": None}, {"text": "fine"}]
    path = _parquet(tmp_path / "nulls.parquet", records)
    with pytest.raises(errors.DataError, match="bad record: no text field 'text'") as e:
        _source([path])
    assert e.value.path.endswith("nulls.parquet:row 2")
    assert _source([path], on_bad_record="skip").read_report.skipped == 1
    with pytest.raises(errors.DataError, match="no column 'text' \\(columns: body\\)"):
        _source([_parquet(tmp_path / "other.parquet", [{"body": "x"}])])
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet at all")
    with pytest.raises(errors.DataError, match="not a Parquet file") as e:
        _source([str(garbage)])
    assert e.value.path.endswith("garbage.parquet")


def _text(row):
    """A one-document row's bytes: its inputs and the last target."""
    at = row["segment_ids"] > 0
    return bytes(np.append(row["input_ids"][at], row["target_ids"][at][-1])
                 .astype(np.uint8).tolist()).decode()


def test_a_mixture_draws_each_source_its_share(tmp_path):
    """A 60-document source and a 12-document one, weighted 1 : 3: over the rows of both (one
    document per row here), a quarter from the first (a seeded subset) and three quarters from
    the second (repeated), the same on every build."""
    big = _jsonl(tmp_path / "big.jsonl", [{"text": f"big {i}"} for i in range(60)])
    small = _jsonl(tmp_path / "small.jsonl", [{"text": f"small {i}"} for i in range(12)])
    mixture = _source([big, small], weights=[1.0, 3.0], pack=False)
    texts = [_text(mixture[i]) for i in range(len(mixture))]
    assert len(texts) == 72
    assert sum(t.startswith("big") for t in texts) == 18
    assert sum(t.startswith("small") for t in texts) == 54
    assert len({t for t in texts if t.startswith("small")}) == 12  # Every one, 4.5 times.
    again = _source([big, small], weights=[1.0, 3.0], pack=False)
    assert np.array_equal(again.index, mixture.index)
    with pytest.raises(errors.ConfigError, match="one weight per glob"):
        _source([big, small], weights=[1.0])
    with pytest.raises(errors.ConfigError, match="finite number > 0"):
        _source([big, small], weights=[1.0, 0.0])


def test_a_mixture_is_the_same_on_every_build_and_adds_up(tmp_path):
    """Without a seed the draw is still fixed (processes feeding the same shard must agree);
    a source with a tiny weight still gets a row, and the shares add up to the rows."""
    big = _jsonl(tmp_path / "big.jsonl", [{"text": f"big {i}"} for i in range(42)])
    tiny = _jsonl(tmp_path / "tiny.jsonl", [{"text": "tiny"}])
    first = _source([big, tiny], weights=[1000.0, 1.0], pack=False, seed=None)
    again = _source([big, tiny], weights=[1000.0, 1.0], pack=False, seed=None)
    assert np.array_equal(first.index, again.index)
    assert len(first) == 43
    assert sum(_text(first[i]) == "tiny" for i in range(len(first))) == 1
