"""Prompts for reinforcement learning: the model completes them, rewards score the completions.

Records are JSONL (or Parquet) lines: ``{"prompt": "...", "answer": "42", ...}`` with the prompt
as text, or TRL's conversational form ``{"prompt": [{"role": "user", "content": "..."}], ...}``
rendered by the tokenizer's chat template with the generation prompt (``chat=True`` makes a text
prompt the user's message too). Every other field of the record (``answer`` ...) is handed to
the reward functions by name, one value per completion.

Each example is one prompt, left-padded to ``max_prompt_tokens`` (``prompt_ids``; the sampler
left-pads: every row's completion starts at the same place), its real length
(``prompt_lengths``) and its index among the split's records (``record_index``: the host finds
the text and the fields by it). A longer prompt keeps its last tokens, counted in a warning at
start -- unless it went through the chat template, whose start the cut would drop: that is
refused by name unless ``cut_long_chat_prompts`` allows it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from titanax import errors
from titanax.config import Configurable
from titanax.data import chat
from titanax.data.declarations import Declared
from titanax.data.documents import (ReadReport, RecordFilesConfig, bad_record, chat_messages,
                                    read_split)
from titanax.data.tokenizer import Tokenizer

_log = logging.getLogger("titanax")

# What each example holds ([max_prompt_tokens], then scalars).
FIELDS = {"prompt_ids": "int32", "prompt_lengths": "int32", "record_index": "int32"}


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One record: its prompt (text, or chat messages), its other fields, where it came from."""

    prompt: Any
    conversational: bool
    fields: Dict[str, Any]
    where: str


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """Which field of a record is the prompt (``read_documents``' record format)."""

    prompt_field: str = "prompt"
    kind: str = "prompt"

    @property
    def fields(self) -> Tuple[str, ...]:
        return (self.prompt_field,)

    def document(self, record: Any, where: str) -> PromptRecord:
        if not isinstance(record, dict):
            raise ValueError("the record is not a JSON object")
        prompt = record.get(self.prompt_field)
        others = {k: v for k, v in record.items() if k != self.prompt_field}
        if isinstance(prompt, str):
            return PromptRecord(prompt, False, others, where)
        if isinstance(prompt, list):
            return PromptRecord(chat_messages(prompt, self.prompt_field, needs_assistant=False),
                                True, others, where)
        raise ValueError(f"no text or message list {self.prompt_field!r} (fields: "
                         f"{', '.join(sorted(record))})")


class Prompts(Configurable):
    """Examples ``{"prompt_ids", "prompt_lengths", "record_index"}`` of prompts to complete."""

    FIELDS = FIELDS
    # What its rows are, for the objectives that read them (train/objective.py).
    READ_BY = "prompts to complete"

    class Config(RecordFilesConfig):
        # Text prompts as the user's message through the chat template (conversational ones
        # always are).
        chat: bool = False
        # Tokens per prompt (left-padded to it; a longer prompt keeps its end, warned at start).
        max_prompt_tokens: int = 128
        # A chat-rendered prompt longer than max_prompt_tokens is refused: keeping its end
        # would cut the template's start (the system turn, the first role markers) and the
        # model would read a conversation it was never shown. True: keep its last tokens too.
        cut_long_chat_prompts: bool = False
        # (Every record trains: no test split unless asked.)
        held_out_fraction = 0.0

        def _validate_values(self):
            if self.max_prompt_tokens < 1:
                yield "max_prompt_tokens", f"must be >= 1, got {self.max_prompt_tokens}"
            yield from super()._validate_values()

    def __init__(self, cfg=None, *, tokenizer: Optional[Tokenizer] = None, **fields):
        """``tokenizer``: the input's (``Input.Config.tokenizer``); default bytes."""
        super().__init__(cfg, **fields)
        cfg = self.config
        if cfg.files is None:
            raise errors.DataError("prompts come from your files", path="files",
                                   suggestion="give globs of .jsonl files of {\"prompt\": ..., "
                                              "\"answer\": ...} records")
        self.tokenizer = tokenizer or Tokenizer.default_config().instantiate()
        self.read_report = ReadReport()
        records = read_split(cfg, record_format=PromptFormat(prompt_field=cfg.prompt_field),
                             report=self.read_report)
        self.records: List[PromptRecord] = []
        tokens: List[List[int]] = []
        self.truncated, longest, first_cut_chat = 0, 0, None
        for record in records:
            ids = self._tokens(record)
            if ids is None:
                continue
            if len(ids) > cfg.max_prompt_tokens:
                self.truncated += 1
                longest = max(longest, len(ids))
                if (record.conversational or cfg.chat) and first_cut_chat is None:
                    first_cut_chat = (record.where, len(ids))
                ids = ids[-cfg.max_prompt_tokens:]
            self.records.append(record)
            tokens.append(ids)
        if first_cut_chat is not None and not cfg.cut_long_chat_prompts:
            where, length = first_cut_chat
            raise errors.DataError(
                f"{self.truncated} chat prompt(s) of the {cfg.split} split are longer than "
                f"max_prompt_tokens={cfg.max_prompt_tokens} (the first: {where}, {length} "
                f"tokens); keeping their last tokens would cut the chat template's start",
                path="max_prompt_tokens",
                suggestion=f"raise it to {longest} (with the objective's max_new_tokens inside "
                           f"the model's max_seq_len), shorten those prompts, or set "
                           f"cut_long_chat_prompts=true to keep their ends")
        if self.truncated:
            _log.warning("%d of the %s split's %d prompts are longer than max_prompt_tokens=%d "
                         "(the longest %d tokens): each keeps its last %d tokens; raise "
                         "max_prompt_tokens to keep them whole", self.truncated, cfg.split,
                         len(self.records), cfg.max_prompt_tokens, longest,
                         cfg.max_prompt_tokens)
        if not self.records:
            raise errors.DataError(f"the {cfg.split} split has no prompt "
                                   f"({self.read_report.text()})", path="files",
                                   suggestion="give more records or lower held_out_fraction")
        self.lengths = np.asarray([len(t) for t in tokens], np.int32)
        self.prompt_ids = np.zeros((len(tokens), cfg.max_prompt_tokens), np.int32)
        for row, ids in enumerate(tokens):
            self.prompt_ids[row, cfg.max_prompt_tokens - len(ids):] = ids
        _log.info("%s split: %s; %d prompt(s), %d truncated to their last %d tokens", cfg.split,
                  self.read_report.text(), len(self.records), self.truncated,
                  cfg.max_prompt_tokens)

    @property
    def record_kind(self) -> str:
        return "prompt"

    @classmethod
    def declare(cls, cfg: "Prompts.Config", *, tokenizer: Tokenizer) -> Declared:
        """Prompt ids of the tokenizer, ``max_prompt_tokens`` positions."""
        return dataclasses.replace(
            Declared.of_tokens(tokenizer, fields=("prompt_ids",), length=cfg.max_prompt_tokens),
            length_field="max_prompt_tokens")

    def _tokens(self, record: PromptRecord) -> Optional[List[int]]:
        tok = self.tokenizer
        if record.conversational or self.config.chat:
            messages = record.prompt if record.conversational else (("user", record.prompt),)
            try:
                ids = tok.encode_chat_prompt(messages)
            except chat.TemplateError as e:
                bad_record(e, where=record.where, on_bad_record=self.config.on_bad_record,
                           report=self.read_report)
                return None
        else:
            ids = tok.encode_prompt(record.prompt)
        if not ids:
            bad_record(ValueError("the prompt has no token"), where=record.where,
                       on_bad_record=self.config.on_bad_record, report=self.read_report)
            return None
        return ids

    def end_ids(self) -> List[int]:
        """The ids that end a completion: the tokenizer's end of sequence, and the chat
        template's end of turn when prompts go through it."""
        tok = self.tokenizer
        ids = [tok.eos_id] if tok.eos_id is not None else []
        if self.config.chat or any(r.conversational for r in self.records[:1]):
            ids += [i for i in tok.chat_end_ids() if i not in ids]
        return ids

    def prompt_of(self, index: int) -> Any:
        """Record ``index``'s prompt as the reward functions get it (text, or messages as
        ``[{"role", "content"}]``)."""
        record = self.records[index]
        if record.conversational:
            return [{"role": r, "content": c} for r, c in record.prompt]
        return record.prompt

    def fields_of(self, index: int) -> Dict[str, Any]:
        """Record ``index``'s other fields."""
        return self.records[index].fields

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        return {"prompt_ids": self.prompt_ids[index],
                "prompt_lengths": self.lengths[index],
                "record_index": np.int32(index)}
