"""Packed rows written once as ArrayRecord shards, read back by ``PackedRows``: training never
re-tokenizes, and every process reads only the rows it feeds (random access, memory mapped).

    python -m titanax.data.pretokenize --files='data/*.jsonl' --out=rows/ \\
        [--tokenizer=tok/] [--seq_len=128] [--format=text|prompt_completion] [--split=train]

A record holds one row: ``input_ids``, ``target_ids``, ``segment_ids``, ``positions`` (int32)
and ``weights`` (float32), ``seq_len`` each, little-endian, in that order. ``<out>/rows.json``
says what the rows are (sequence length, tokenizer, vocabulary, what packing did), and
``PackedRows`` refuses shards whose description does not match its config. The directory must be
new or empty.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
from absl import flags

from titanax import command_line, errors
from titanax.config import Configurable
from titanax.data.packed import FIELDS, PackedDocuments
from titanax.data.tokenizer import Tokenizer
from titanax.data.declarations import Declared
from titanax.io.files import new_directory, read_json_object

DESCRIPTION = "rows.json"
DTYPES = {name: np.dtype("<f4") if name == "weights" else np.dtype("<i4") for name in FIELDS}


def tokenizer_identity(tokenizer: Tokenizer) -> Dict[str, Any]:
    """What makes two tokenizers give the same rows: the file's bytes (a hash), the vocabulary
    size and the boundary ids."""
    file = getattr(tokenizer, "file", None)
    digest = None
    if file is not None:
        with open(file, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    return {"tokenizer_sha256": digest, "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}


def encode_row(row: Dict[str, np.ndarray]) -> bytes:
    return b"".join(np.ascontiguousarray(row[name], DTYPES[name]).tobytes() for name in FIELDS)


def decode_row(record: bytes, seq_len: int) -> Dict[str, np.ndarray]:
    width = 4 * seq_len
    if len(record) != width * len(FIELDS):
        raise errors.DataError(f"a record of {len(record)} bytes is not a row of {seq_len} "
                               "tokens", path="rows", suggestion="re-run titanax.data.pretokenize")
    return {name: np.frombuffer(record, DTYPES[name], seq_len, i * width).astype(
        np.float32 if name == "weights" else np.int32) for i, name in enumerate(FIELDS)}


def check_target(out: str) -> str:
    """``out`` as an absolute path, refused when it holds anything or cannot be made."""
    return new_directory(out, where="--out", error=errors.DataError)


def write_rows(source: PackedDocuments, out: str, *, rows_per_shard: int = 100_000,
               progress: bool = True) -> Dict[str, Any]:
    """Writes ``source``'s rows into ``out`` as ArrayRecord shards; returns the description."""
    from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
    out = check_target(out)
    os.makedirs(out, exist_ok=True)
    count = len(source)
    shards = max(1, -(-count // rows_per_shard))
    largest = -1  # The largest id written (what a model reading the rows must cover).
    started = time.perf_counter()
    for shard in range(shards):
        path = os.path.join(out, f"rows-{shard:05d}-of-{shards:05d}.array_record")
        writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
        for index in range(shard * rows_per_shard, min(count, (shard + 1) * rows_per_shard)):
            row = source[index]
            largest = max(largest, int(row["input_ids"].max()), int(row["target_ids"].max()))
            writer.write(encode_row(row))
        writer.close()
        if progress:
            print(f"titanax: wrote shard {shard + 1}/{shards} "
                  f"({time.perf_counter() - started:.1f}s)", flush=True)
    tokenizer = source.tokenizer
    description = {
        "rows": count, "seq_len": source.config.seq_len, "fields": list(FIELDS),
        "max_id": largest,
        "tokenizer": getattr(tokenizer, "file", None), **tokenizer_identity(tokenizer),
        "format": source.record_kind, "split": source.config.split,
        "report": source.report.text(), "read": source.read_report.text()}
    with open(os.path.join(out, DESCRIPTION), "w", encoding="utf-8") as f:
        json.dump(description, f, indent=2)
    return description


class PackedRows(Configurable):
    """Rows written by ``titanax.data.pretokenize``, read by random access."""

    class Config(Configurable.Config):
        # The directory the rows were written to.
        path: Optional[str] = None
        # Tokens per row; None: as written (a number that differs is refused).
        seq_len: Optional[int] = None

        def _validate_values(self):
            if self.seq_len is not None and self.seq_len < 1:
                yield "seq_len", f"must be >= 1 (or None: as written), got {self.seq_len}"

    def __init__(self, cfg=None, *, tokenizer: Optional[Tokenizer] = None, **fields):
        """``tokenizer``: the input's; its vocabulary must be the one the rows were made with."""
        super().__init__(cfg, **fields)
        cfg = self.config
        self.description = _description(cfg.path)
        self.seq_len = int(self.description["seq_len"])
        if cfg.seq_len is not None and cfg.seq_len != self.seq_len:
            raise errors.DataError(f"the rows hold {self.seq_len} tokens, not {cfg.seq_len}",
                                   path="seq_len", suggestion="leave seq_len unset, or "
                                                              "pre-tokenize again")
        if tokenizer is not None:
            identity = tokenizer_identity(tokenizer)
            differing = [k for k, v in identity.items() if self.description.get(k) != v]
            if differing:
                raise errors.DataError(
                    f"the rows were made with another tokenizer "
                    f"({self.description['tokenizer'] or 'bytes'}, "
                    f"{self.description['vocab_size']} tokens): "
                    + ", ".join(f"{k} {self.description.get(k)!r} here, {identity[k]!r} in the "
                                "input's" for k in differing), path="tokenizer.path",
                    suggestion="use the tokenizer the rows were made with, or pre-tokenize "
                               "again")
        from array_record.python import array_record_data_source  # pylint: disable=import-outside-toplevel
        shards = sorted(glob.glob(os.path.join(cfg.path, "rows-*.array_record")))
        self._source = array_record_data_source.ArrayRecordDataSource(shards)
        if len(self._source) != self.description["rows"]:
            raise errors.DataError(f"{len(self._source)} rows on disk, {self.description['rows']}"
                                   " described", path=f"path: {cfg.path}",
                                   suggestion="a shard is missing or damaged: pre-tokenize again")

    @classmethod
    def declare(cls, cfg: "PackedRows.Config", *, tokenizer: Any = None) -> Declared:
        """What the rows hold, from ``rows.json``: ids up to the largest one written (older
        sets, without it: the vocabulary they were made with), ``seq_len`` positions."""
        del tokenizer
        description = _description(cfg.path)
        if description.get("max_id") is not None:
            count, said = int(description["max_id"]) + 1, (
                f"the pre-tokenized rows {cfg.path} (largest id {description['max_id']})")
        else:
            count = int(description["vocab_size"])
            said = f"the pre-tokenized rows {cfg.path} ({count}-token vocabulary)"
        vocabulary = description.get("vocab_size")
        return Declared(ids={"input_ids": count, "target_ids": count}, ids_from=said,
                        length=int(description["seq_len"]),
                        vocabulary=int(vocabulary) if vocabulary is not None else None)

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        return decode_row(self._source[index], self.seq_len)


def _description(path: Optional[str]) -> Dict[str, Any]:
    """``<path>/rows.json``; a missing or unreadable one is a ``DataError``."""
    if not path or not os.path.isfile(os.path.join(path, DESCRIPTION)):
        raise errors.DataError("no pre-tokenized rows here", path=f"path: {path}",
                               suggestion="write them with python -m titanax.data.pretokenize")
    return read_json_object(os.path.join(path, DESCRIPTION), error=errors.DataError,
                            suggestion="pre-tokenize again")


def _define_flags() -> None:
    """The command's flags (defined only when it runs: modules imported together must not
    define the same names twice)."""
    flags.DEFINE_multi_string("files", None, "Glob(s) of .jsonl or text files; unset: the "
                              "bundled plays.")
    flags.DEFINE_string("out", None, "Directory to write the rows into (new or empty).")
    flags.DEFINE_string("tokenizer", None, "tokenizer.json or its directory; unset: bytes.")
    flags.DEFINE_integer("seq_len", 128, "Tokens per row.")
    flags.DEFINE_enum("format", "text", ["text", "prompt_completion", "chat"], "Record format.")
    flags.DEFINE_enum("split", "train", ["train", "test"], "Which split to write.")
    flags.DEFINE_float("held_out_fraction", 0.0, "Documents held out for the test split.")
    flags.DEFINE_integer("rows_per_shard", 100_000, "Rows per ArrayRecord file.")


def main_body(argv: Sequence[str]) -> int:
    del argv  # (Positional arguments are refused by command_line.main_of.)
    given = flags.FLAGS
    if not given.out:
        raise errors.LaunchFlagError("missing", path="--out", suggestion="e.g. --out=rows/train")
    if given.rows_per_shard < 1:
        raise errors.LaunchFlagError(f"must be >= 1, got {given.rows_per_shard}",
                                     path="--rows_per_shard", suggestion="e.g. 100000")
    if given.seq_len < 1:
        raise errors.LaunchFlagError(f"must be >= 1, got {given.seq_len}", path="--seq_len",
                                     suggestion="e.g. 128")
    if not 0 <= given.held_out_fraction < 1:
        raise errors.LaunchFlagError(f"must be in [0, 1), got {given.held_out_fraction}",
                                     path="--held_out_fraction", suggestion="e.g. 0.1")
    check_target(given.out)  # Refused before the corpus is read.
    tokenizer = Tokenizer.default_config().set(path=given.tokenizer).instantiate()
    files: Optional[List[str]] = given.files or None
    source = PackedDocuments.default_config().set(
        files=files, seq_len=given.seq_len, format=given.format, split=given.split,
        held_out_fraction=given.held_out_fraction).instantiate(tokenizer=tokenizer)
    description = write_rows(source, given.out, rows_per_shard=given.rows_per_shard)
    print(f"titanax: {description['rows']} rows of {description['seq_len']} tokens in "
          f"{os.path.abspath(given.out)} ({description['report']})", flush=True)
    return 0


if __name__ == "__main__":
    command_line.run(main_body, name="titanax.data.pretokenize", define_flags=_define_flags)
