"""Documents from the user's files: JSONL records or plain text, with a counted bad-record policy.

A *document* is what a model should read as one piece: a ``{"text": ...}`` record, a
``{"prompt": ..., "completion": ...}`` pair (fine-tuning: only the completion is trained on), or
a blank-line-separated paragraph of a text file. Every document keeps where it came from
(``file:line``), so a problem is named where it is. A line that is not JSON, or lacks the field,
stops the run (``on_bad_record="stop"``, the default) or is skipped and counted
(``"skip"``); an empty file is said so. Nothing is dropped silently.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from typing import Iterator, List, Optional, Sequence

from titanax import errors

_log = logging.getLogger("titanax")


@dataclasses.dataclass(frozen=True)
class Document:
    """One document: its text (or prompt and completion) and where it came from."""

    # The whole text; for a prompt/completion pair, the completion.
    text: str
    # The prompt of a pair (not trained on); "" for plain documents.
    prompt: str = ""
    # "file:line" (JSONL) or "file:paragraph" (text).
    where: str = ""


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


def matching_files(patterns: Sequence[str], *, where: str) -> List[str]:
    """The files of every pattern, sorted; a pattern that matches none is refused (a typo in
    one of several globs would silently drop that data)."""
    paths = set()
    for pattern in patterns:
        found = {p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)}
        if not found:
            raise errors.DataError(f"no files match {pattern!r}", path=where,
                                   suggestion="give globs of .jsonl or text files")
        paths |= found
    return sorted(paths)


def read_documents(paths: Sequence[str], *, fields: Sequence[str], on_bad_record: str = "stop",
                   report: Optional[ReadReport] = None, where: str = "files"
                   ) -> Iterator[Document]:
    """The documents of ``paths`` in order. ``fields``: ``("text",)`` for plain records, or
    ``(prompt_field, completion_field)`` for pairs. ``.jsonl`` / ``.json`` files are read as
    JSON lines; other files as text, one document per blank-line-separated paragraph."""
    report = report if report is not None else ReadReport()
    for path in paths:
        report.files += 1
        before = report.documents
        if path.endswith((".jsonl", ".json")):
            yield from _jsonl(path, fields, on_bad_record, report)
        else:
            yield from _paragraphs(path, fields, report)
        if report.documents == before:
            report.empty_files += 1
            _log.warning("%s holds no document", path)
    if report.documents == 0:
        raise errors.DataError(f"the files hold no document ({report.text()})", path=where,
                               suggestion="check the files and the record fields")


def _jsonl(path: str, fields: Sequence[str], on_bad_record: str,
           report: ReadReport) -> Iterator[Document]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"not UTF-8 ({e.reason} at byte {e.start})") from e
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("the line is not a JSON object")
                missing = [name for name in fields if not isinstance(record.get(name), str)]
                if missing:
                    raise ValueError(f"no text field {missing[0]!r} (fields: "
                                     f"{', '.join(sorted(record)) or 'none'})")
            except ValueError as e:
                if on_bad_record == "skip":
                    report.skipped += 1
                    _log.warning("skipped %s: %s", where, e)
                    continue
                raise errors.DataError(f"bad record: {e}", path=where,
                                       suggestion="fix the line, or skip bad records with "
                                                  "on_bad_record='skip' (they are counted)")
            report.documents += 1
            if len(fields) == 1:
                yield Document(text=record[fields[0]], where=where)
            else:
                yield Document(text=record[fields[1]], prompt=record[fields[0]], where=where)


def _paragraphs(path: str, fields: Sequence[str], report: ReadReport) -> Iterator[Document]:
    if len(fields) != 1:
        raise errors.DataError("a prompt/completion source needs JSONL records", path=path,
                               suggestion="give .jsonl files with the prompt and completion "
                                          "fields")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise errors.DataError(f"not UTF-8 text ({e.reason} at byte {e.start})", path=path,
                               suggestion="convert it to UTF-8 or leave it out") from e
    for index, paragraph in enumerate(p for p in text.split("\n\n") if p.strip()):
        report.documents += 1
        yield Document(text=paragraph.strip("\n"), where=f"{path}:paragraph {index + 1}")
