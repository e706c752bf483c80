"""Unpaired preferences (KTO's data): a prompt, one completion and whether it is desirable.

Records are JSONL (or Parquet) lines in one of TRL's two forms:

- text: ``{"prompt": "...", "completion": "...", "label": true}``;
- conversational: ``{"prompt": [messages], "completion": [messages], "label": false}``,
  rendered by the tokenizer's chat template (``data/chat.py``), the completion's assistant
  tokens scored.

``label`` is JSON ``true`` / ``false`` (desirable / undesirable); anything else is a bad record.

Each record becomes one example of two rows of ``seq_len`` positions, tokenized and cut as
preference pairs' rows are (``data/preference.py``), but each row on its own (as TRL does):
``input_ids`` / ``target_ids`` / ``weights`` of ``prompt + completion``, and ``kl_input_ids`` / ``kl_target_ids`` /
``kl_weights`` of the same prompt with a *mismatched* completion -- KTO's estimate of the
policy's KL to its reference is taken on such pairs. The mismatched completion of the record at
place ``i`` of the split's order (from ``seed``) is the completion of the record at ``i - 1``
(the first record's: the last one's): fixed per record, so every mesh, process count and batch
size pairs alike (TRL rotates the completions by one within each device batch instead). Plus
``label`` (1.0 / 0.0) per example.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, List, Tuple

import numpy as np

from titanax import errors
from titanax.data.declarations import Declared
from titanax.data.documents import ReadReport, chat_messages
from titanax.data.preference import CompletionRows, PairReport
from titanax.data.tokenizer import Tokenizer

_log = logging.getLogger("titanax")

# What each example holds: two rows of [seq_len], and the label.
FIELDS = {"input_ids": "int32", "target_ids": "int32", "weights": "float32",
          "kl_input_ids": "int32", "kl_target_ids": "int32", "kl_weights": "float32",
          "label": "float32"}


@dataclasses.dataclass(frozen=True)
class LabelledCompletion:
    """One record: its prompt and completion (text, or chat messages), its label, its place."""

    prompt: Any
    completion: Any
    label: bool
    conversational: bool
    where: str


@dataclasses.dataclass(frozen=True)
class UnpairedFormat:
    """Which fields of a record make a labelled completion (``read_documents``' format)."""

    prompt_field: str = "prompt"
    completion_field: str = "completion"
    label_field: str = "label"
    kind: str = "unpaired preference"

    @property
    def fields(self) -> Tuple[str, ...]:
        return (self.prompt_field, self.completion_field, self.label_field)

    def document(self, record: Any, where: str) -> LabelledCompletion:
        if not isinstance(record, dict):
            raise ValueError("the record is not a JSON object")
        for name in self.fields:
            if record.get(name) is None:
                raise ValueError(f"no field {name!r} (fields: {', '.join(sorted(record))})")
        label = record[self.label_field]
        if not isinstance(label, (bool, np.bool_)):
            raise ValueError(f"{self.label_field!r} must be true or false, got {label!r}")
        prompt, completion = record[self.prompt_field], record[self.completion_field]
        if isinstance(prompt, str) and isinstance(completion, str):
            return LabelledCompletion(prompt, completion, bool(label), conversational=False,
                                      where=where)
        if isinstance(prompt, list) and isinstance(completion, list):
            return LabelledCompletion(chat_messages(prompt, self.prompt_field,
                                                    needs_assistant=False),
                                      chat_messages(completion, self.completion_field),
                                      bool(label), conversational=True, where=where)
        raise ValueError(f"{self.prompt_field!r} and {self.completion_field!r} must both be text "
                         "or both lists of chat messages")


@dataclasses.dataclass(frozen=True)
class _WithMismatch:
    """A record's prompt with its own completion and a mismatched one (the rows' sides)."""

    prompt: Any
    completion: Any
    kl: Any
    conversational: bool
    where: str


class UnpairedPreferences(CompletionRows):
    """Examples ``{"input_ids", "target_ids", "weights", "kl_...", "label"}`` of labelled
    completions (see the module docstring)."""

    # What its rows are, for the objectives that read them (train/objective.py).
    READ_BY = "labelled completions (KTO's unpaired preferences)"
    FIELDS = FIELDS
    # The fields with one value per example (the rest are rows of seq_len).
    PER_ROW = ("label",)
    SIDES = ("completion", "kl")
    FIELD_PREFIX = {"completion": "", "kl": "kl_"}
    # Each row cut on its own, as TRL's: a record's log-probs do not depend on its neighbour's
    # completion; a mismatched row left with nothing to score only leaves the KL estimate.
    SHARED_PROMPT = False
    REQUIRED_SIDES = ("completion",)

    class Config(CompletionRows.Config):
        # The record fields of the completion and of its label (true: desirable).
        completion_field: str = "completion"
        label_field: str = "label"

    def __init__(self, cfg=None, *, tokenizer: Tokenizer = None, **fields):
        """``tokenizer``: the input's (``Input.Config.tokenizer``); default bytes."""
        super().__init__(cfg, **fields)
        cfg = self.config
        if cfg.files is None:
            raise errors.DataError("labelled completions come from your files", path="files",
                                   suggestion="give globs of .jsonl files of {\"prompt\", "
                                              "\"completion\", \"label\": true|false} records")
        self.tokenizer = tokenizer or Tokenizer.default_config().instantiate()
        self.read_report, self.report = ReadReport(), PairReport(seq_len=cfg.seq_len, noun="record")
        records = self._records()
        if len(records) < 2:
            raise errors.DataError(
                f"the {cfg.split} split has {len(records)} record(s): KTO's KL estimate pairs "
                "each prompt with another record's completion", path="files",
                suggestion="give more records or lower held_out_fraction")
        rows = []
        for index, record in enumerate(records):
            row = self._rows(_WithMismatch(record.prompt, record.completion,
                                           records[index - 1].completion,
                                           record.conversational, record.where))
            if row is not None:
                row["label"] = np.float32(record.label)
                rows.append(row)
        if not rows:
            raise errors.DataError(f"the {cfg.split} split has no record ({self.report.text()})",
                                   path="files", suggestion="give more records or longer rows")
        self.rows = {name: np.stack([r[name] for r in rows]) for name in FIELDS}
        self.report.pairs = len(rows)
        labels = self.rows["label"]
        _log.info("%s split: %s; %s; %d desirable, %d undesirable", cfg.split,
                  self.read_report.text(), self.report.text(), int(labels.sum()),
                  int(len(labels) - labels.sum()))

    @property
    def record_kind(self) -> str:
        return "unpaired preference"

    @classmethod
    def declare(cls, cfg: "UnpairedPreferences.Config", *, tokenizer: Tokenizer) -> Declared:
        """Both rows hold ids of the tokenizer, ``seq_len`` positions each."""
        return Declared.of_tokens(tokenizer, fields=("input_ids", "target_ids", "kl_input_ids",
                                                     "kl_target_ids"), length=cfg.seq_len)

    def _records(self) -> List[LabelledCompletion]:
        cfg = self.config
        return self._split_records(UnpairedFormat(prompt_field=cfg.prompt_field,
                                                  completion_field=cfg.completion_field,
                                                  label_field=cfg.label_field))
