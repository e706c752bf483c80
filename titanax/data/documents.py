"""Documents from the user's files: JSONL, Parquet or plain text, with a counted bad-record policy.

A *document* is what a model should read as one piece: a ``{"text": ...}`` record, a
``{"prompt": ..., "completion": ...}`` pair (fine-tuning: only the completion is trained on), a
``{"messages": [{"role": ..., "content": ...}, ...]}`` conversation (only the assistant's turns
are trained on; ``chat.py`` renders it), or a blank-line-separated paragraph of a text file.
``.jsonl`` / ``.json`` files hold one JSON record per line; ``.parquet`` files one record per row
(columns named like the fields; pyarrow, the ``parquet`` extra). Every document keeps where it
came from (``file:line`` or ``file:row``), so a problem is named where it is. A record that is
not JSON, or lacks its field, stops the run (``on_bad_record="stop"``, the default) or is skipped
and counted (``"skip"``); an empty file is said so. Nothing is dropped silently.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from typing import Any, Iterator, List, Literal, Optional, Sequence, Tuple

from titanax import errors
from titanax.config import Configurable

_log = logging.getLogger("titanax")

# The roles a chat message may have.
CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class Document:
    """One document: its text (or prompt and completion, or messages) and where it came from."""

    # The whole text; for a prompt/completion pair, the completion; "" for a conversation.
    text: str
    # The prompt of a pair (not trained on); "" for plain documents.
    prompt: str = ""
    # "file:line" (JSONL), "file:row" (Parquet) or "file:paragraph" (text).
    where: str = ""
    # A conversation's messages, ((role, content), ...); empty for the other kinds.
    messages: Tuple[Tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class RecordFormat:
    """Which fields of a record make a document, by kind."""

    # "text", "prompt_completion" or "chat".
    kind: str = "text"
    # The field of a text record.
    text_field: str = "text"
    # The fields of a prompt/completion pair.
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    # The field of a conversation's list of {"role": ..., "content": ...} messages.
    messages_field: str = "messages"

    @property
    def fields(self) -> Tuple[str, ...]:
        """The record fields (Parquet columns) this kind reads."""
        return {"text": (self.text_field,),
                "prompt_completion": (self.prompt_field, self.completion_field),
                "chat": (self.messages_field,)}[self.kind]

    def document(self, record: Any, where: str) -> Document:
        """The document of one record; a ``ValueError`` saying what is wrong with it."""
        if not isinstance(record, dict):
            raise ValueError("the record is not a JSON object")
        missing = [name for name in self.fields if record.get(name) is None
                   or (self.kind != "chat" and not isinstance(record.get(name), str))]
        if missing:
            raise ValueError(f"no {'messages' if self.kind == 'chat' else 'text'} field "
                             f"{missing[0]!r} (fields: {', '.join(sorted(record)) or 'none'})")
        if self.kind == "text":
            return Document(text=record[self.text_field], where=where)
        if self.kind == "prompt_completion":
            return Document(text=record[self.completion_field],
                            prompt=record[self.prompt_field], where=where)
        return Document(text="", where=where,
                        messages=chat_messages(record[self.messages_field], self.messages_field))


def chat_messages(value: Any, field: str, *,
                  needs_assistant: bool = True) -> Tuple[Tuple[str, str], ...]:
    """The ``(role, content)`` pairs of a record's message list (``needs_assistant``: one of
    them must be the assistant's, which is what is trained on); a ``ValueError`` naming what is
    wrong."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{field!r} is not a non-empty list of messages")
    out = []
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"{field}[{index}] is not a {{\"role\": ..., \"content\": ...}} "
                             "object of strings")
        if message["role"] not in CHAT_ROLES:
            raise ValueError(f"{field}[{index}] has role {message['role']!r}, not one of "
                             f"{', '.join(CHAT_ROLES)}")
        out.append((message["role"], message["content"]))
    if needs_assistant and not any(role == "assistant" for role, _ in out):
        raise ValueError("the conversation has no assistant message to train on")
    return tuple(out)


@dataclasses.dataclass
class ReadReport:
    """What reading the files found."""

    files: int = 0
    documents: int = 0
    skipped: int = 0
    empty_files: int = 0

    def text(self) -> str:
        return (f"{self.documents} document(s) from {self.files} file(s)"
                + (f"; {self.skipped} bad record(s) skipped" if self.skipped else "")
                + (f"; {self.empty_files} empty file(s)" if self.empty_files else ""))


def log_split(split: str, read: ReadReport, made: str, *, lost: bool) -> None:
    """The split's line at start: what was read and what it became -- a warning, with how to
    keep them whole, when examples lost tokens to the row length."""
    _log.log(logging.WARNING if lost else logging.INFO, "%s split: %s; %s%s", split, read.text(),
             made, " (a longer source.seq_len keeps them whole)" if lost else "")


def matching_files(patterns: Sequence[str], *, where: str) -> List[str]:
    """The files of every pattern, sorted (``bundled:<name>/...``: Titanax's own data); a
    pattern that matches none is refused (a typo in one of several globs would silently drop
    that data)."""
    from titanax.data import bundled  # pylint: disable=import-outside-toplevel
    paths = set()
    for pattern in patterns:
        found = {p for p in glob.glob(bundled.resolve(pattern), recursive=True)
                 if os.path.isfile(p)}
        if not found:
            raise errors.DataError(f"no files match {pattern!r}", path=where,
                                   suggestion="give globs of .jsonl, .parquet or text files")
        paths |= found
    return sorted(paths)


def read_documents(paths: Sequence[str], *, record_format: RecordFormat = RecordFormat(),
                   on_bad_record: str = "stop", report: Optional[ReadReport] = None,
                   where: str = "files") -> Iterator[Document]:
    """The documents of ``paths`` in order. ``.jsonl`` / ``.json`` files are read as JSON lines,
    ``.parquet`` files row by row; other files as text, one document per blank-line-separated
    paragraph."""
    report = report if report is not None else ReadReport()
    for path in paths:
        report.files += 1
        before = report.documents
        if path.endswith((".jsonl", ".json")):
            records = _jsonl(path)
        elif path.endswith(".parquet"):
            records = _parquet(path, record_format)
        else:
            records = _paragraphs(path, record_format)
        for place, record in records:
            try:
                if isinstance(record, Exception):
                    raise record
                document = record_format.document(record, place)
            except ValueError as e:
                if on_bad_record == "skip":
                    report.skipped += 1
                    _log.warning("skipped %s: %s", place, e)
                    continue
                raise errors.DataError(f"bad record: {e}", path=place,
                                       suggestion="fix the record, or skip bad records with "
                                                  "on_bad_record='skip' (they are counted)")
            report.documents += 1
            yield document
        if report.documents == before:
            report.empty_files += 1
            _log.warning("%s holds no document", path)
    if report.documents == 0:
        raise errors.DataError(f"the files hold no document ({report.text()})", path=where,
                               suggestion="check the files and the record fields")


def _jsonl(path: str) -> Iterator[Tuple[str, Any]]:
    """``(file:line, record)`` per non-blank line; a line that does not parse gives its
    ``ValueError`` as the record."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"not UTF-8 ({e.reason} at byte {e.start})") from e
                record = json.loads(line)
            except ValueError as e:
                record = e
            yield f"{path}:{number}", record


def _parquet(path: str, record_format: RecordFormat) -> Iterator[Tuple[str, Any]]:
    """``(file:row N, record)`` per row, reading only the format's columns, a batch at a time."""
    try:
        import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise errors.DataError("reading Parquet needs pyarrow", path=path,
                               suggestion="pip install 'titanax[parquet]'") from e
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # pylint: disable=broad-except  (pyarrow's own errors)
        raise errors.DataError(f"not a Parquet file: {e}", path=path,
                               suggestion="give .parquet files written by pyarrow, pandas or "
                                          "datasets") from e
    columns = table.schema_arrow.names
    missing = [name for name in record_format.fields if name not in columns]
    if missing:
        raise errors.DataError(f"no column {missing[0]!r} (columns: {', '.join(columns)})",
                               path=path, suggestion="name the field the documents are in "
                                                     "(text_field / prompt_field / ...)")
    row = 0
    for batch in table.iter_batches(columns=list(record_format.fields)):
        for record in batch.to_pylist():
            row += 1
            yield f"{path}:row {row}", record


def _paragraphs(path: str, record_format: RecordFormat) -> Iterator[Tuple[str, Any]]:
    if record_format.kind != "text":
        raise errors.DataError(f"{record_format.kind} records come from JSONL or Parquet files",
                               path=path,
                               suggestion="give .jsonl or .parquet files with the fields "
                                          f"{', '.join(record_format.fields)}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise errors.DataError(f"not UTF-8 text ({e.reason} at byte {e.start})", path=path,
                               suggestion="convert it to UTF-8 or leave it out") from e
    for index, paragraph in enumerate(p for p in text.split("\n\n") if p.strip()):
        yield f"{path}:paragraph {index + 1}", {record_format.text_field: paragraph.strip("\n")}


# --- What every source of records shares -------------------------------------------------------


class RecordFilesConfig(Configurable.Config):
    """The fields of a source that reads records of prompts from files and splits them
    (prompts, preference pairs, labelled completions)."""

    # Glob(s) of .jsonl / .parquet files of records (see the source's docstring for the forms).
    files: Optional[List[str]] = None
    # The record field of the prompt.
    prompt_field: str = "prompt"
    # "train" or "test": the last held_out_fraction of the records (in file order) is the test
    # split.
    split: Literal["train", "test"] = "train"
    # In [0, 1).
    held_out_fraction: float = 0.1
    # A record that is not JSON, lacks a field, or (chat) that the template refuses: "stop" (an
    # error naming file:line) or "skip" (counted and logged).
    on_bad_record: Literal["stop", "skip"] = "stop"
    # The records' order, from this seed (None: file order).
    seed: Optional[int] = 0

    def _validate_values(self):
        yield from split_field_problems(self)


def read_split(cfg: RecordFilesConfig, *, record_format: Any, report: "ReadReport") -> List[Any]:
    """The configured split's records of ``cfg.files``, read by ``record_format``, in the
    order from ``cfg.seed``."""
    records = list(read_documents(matching_files(cfg.files, where="files"),
                                  record_format=record_format, on_bad_record=cfg.on_bad_record,
                                  report=report))
    return split_of(records, split=cfg.split, held_out_fraction=cfg.held_out_fraction,
                    seed=cfg.seed)


def split_field_problems(cfg: Any):
    """``(field, message)`` for a source config's ``held_out_fraction`` and ``seed``."""
    if not 0.0 <= cfg.held_out_fraction < 1.0:
        yield "held_out_fraction", f"must be in [0, 1), got {cfg.held_out_fraction}"
    if cfg.seed is not None and not 0 <= cfg.seed < 2 ** 32:
        yield "seed", f"must be in [0, 2**32) (or None: file order), got {cfg.seed}"


def split_of(items: List[Any], *, split: str, held_out_fraction: float,
             seed: Optional[int]) -> List[Any]:
    """The ``split`` ("train" / "test": the last ``held_out_fraction`` of ``items``, in file
    order) in an order from ``seed`` (None: file order)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    cut = int(round(len(items) * (1.0 - held_out_fraction)))
    chosen = items[:cut] if split == "train" else items[cut:]
    if seed is not None:
        order = np.random.default_rng(seed).permutation(len(chosen))
        chosen = [chosen[i] for i in order]
    return chosen


def bad_record(error: Exception, *, where: str, on_bad_record: str,
               report: "ReadReport") -> None:
    """A record the chat template refuses: a ``DataError`` naming it (``on_bad_record``
    "stop"), or counted and logged ("skip")."""
    if on_bad_record != "skip":
        raise errors.DataError(f"bad record: {error}", path=where,
                               suggestion="fix the conversation or the template, or skip bad "
                                          "records with on_bad_record='skip'") from error
    report.skipped += 1
    _log.warning("skipped %s: %s", where, error)
