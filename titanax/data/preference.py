"""Preference pairs: a prompt with a chosen and a rejected completion, as two rows side by side.

Records are JSONL (or Parquet) lines in one of the two forms preference data comes in:

- text: ``{"prompt": "...", "chosen": "...", "rejected": "..."}``;
- conversational (TRL's): ``{"chosen": [messages], "rejected": [messages]}``, the shared prompt
  inside both lists (TRL's implicit prompt), or apart as ``"prompt": [messages]``. Rendered by
  the tokenizer's chat template (``data/chat.py``); only the assistant's tokens are scored.

Each pair becomes one example of two rows of ``seq_len`` positions, ``chosen_*`` and
``rejected_*`` (``input_ids``, ``target_ids``, ``weights``, ``valid``): a row is ``prompt +
completion`` shifted by one, padded at the end; ``weights`` mark the targets that are the
completion's tokens, ``valid`` every target that is a token (not padding: ORPO's SFT term covers
the prompt too) -- so the sum of a row's weighted target log-probs is the completion's log-prob given the
prompt (and the completion before each token). Both rows of a pair live in the same example, so
they are always in the same batch shard. Text pairs: ``[bos] + prompt`` and ``completion +
[eos]``, the tokenizer's special tokens where it has them; without a tokenizer (bytes) the
prompt and completions are their UTF-8 bytes, no start or end token (a pair with an empty
prompt then cannot score its completion's first token, which has nothing before it).

**Long pairs** (``prompt + completion`` over ``seq_len + 1`` tokens) are cut by one rule, stated
here and counted in the log: the prompt keeps its *last* tokens, at most as many as leave room
for the longer completion, but never fewer than half a row (if it has them); then each completion
keeps its *first* tokens, as many as fit. Both rows of a pair keep the same prompt.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from titanax import errors
from titanax.config import Configurable
from titanax.data import chat
from titanax.data.declarations import Declared
from titanax.data.documents import (ReadReport, RecordFilesConfig, bad_record, chat_messages,
                                    log_split, read_split)
from titanax.data.tokenizer import Tokenizer


SIDES = ("chosen", "rejected")
ROW_FIELDS = ("input_ids", "target_ids", "weights", "valid")
# What each example holds, each [seq_len] (what --compile_only builds a batch's shape from).
FIELDS = {f"{side}_{name}": "int32" if name.endswith("ids") else "float32"
          for side in SIDES for name in ROW_FIELDS}


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """One record: its prompt and completions (text, or chat messages) and where it came from."""

    prompt: Any
    chosen: Any
    rejected: Any
    conversational: bool
    where: str


@dataclasses.dataclass(frozen=True)
class PreferenceFormat:
    """Which fields of a record make a pair (``read_documents``' record format)."""

    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    kind: str = "preference"

    @property
    def fields(self) -> Tuple[str, ...]:
        """The columns a Parquet file must have."""
        return (self.prompt_field, self.chosen_field, self.rejected_field)

    def document(self, record: Any, where: str) -> PreferencePair:
        """The pair of one record; a ``ValueError`` saying what is wrong with it."""
        if not isinstance(record, dict):
            raise ValueError("the record is not a JSON object")
        for name in (self.chosen_field, self.rejected_field):
            if record.get(name) is None:
                raise ValueError(f"no field {name!r} (fields: {', '.join(sorted(record))})")
        chosen, rejected = record[self.chosen_field], record[self.rejected_field]
        prompt = record.get(self.prompt_field)
        if isinstance(chosen, str) and isinstance(rejected, str):
            if not isinstance(prompt, str):
                raise ValueError(f"a text pair needs a text field {self.prompt_field!r}")
            if not prompt.strip():
                raise ValueError(f"{self.prompt_field!r} is empty: the two completions would "
                                 "answer no question")
            self._differ(chosen, rejected)
            return PreferencePair(prompt, chosen, rejected, conversational=False, where=where)
        if isinstance(chosen, list) and isinstance(rejected, list):
            head = () if prompt is None else chat_messages(prompt, self.prompt_field,
                                                           needs_assistant=False)
            sides = (chat_messages(chosen, self.chosen_field),
                     chat_messages(rejected, self.rejected_field))
            for name, messages in zip((self.chosen_field, self.rejected_field), sides):
                if messages[-1][0] != "assistant":
                    raise ValueError(f"{name!r} ends with a {messages[-1][0]} turn: a "
                                     "completion is the assistant's answer, last")
            self._differ(*sides)
            return PreferencePair(head, *sides, conversational=True, where=where)
        raise ValueError(f"{self.chosen_field!r} and {self.rejected_field!r} must both be text or "
                         "both lists of chat messages")


    def _differ(self, chosen: Any, rejected: Any) -> None:
        if chosen == rejected:
            raise ValueError(f"{self.chosen_field!r} and {self.rejected_field!r} are the same: "
                             "the pair prefers nothing")


@dataclasses.dataclass
class PairReport:
    """What became of the pairs."""

    seq_len: int
    # What one example is, in the log ("pair"; KTO's: "record").
    noun: str = "pair"
    pairs: int = 0
    truncated: int = 0
    truncated_tokens: int = 0
    dropped: int = 0
    # Pairs whose two rows, cut to seq_len, are the same (they differ only past it): where.
    same_when_cut: List[str] = dataclasses.field(default_factory=list)

    def text(self) -> str:
        return (f"{self.pairs} {self.noun}(s) into rows of {self.seq_len}; {self.truncated} truncated "
                f"({self.truncated_tokens} tokens: the prompt's start, then the completions' "
                f"ends); {self.dropped} dropped (nothing of a completion left to score)")


def _last_span(trained: np.ndarray) -> np.ndarray:
    """``trained`` with only its last run of True kept: the final assistant message -- the
    completion a pair compares (TRL's); earlier assistant turns belong to the prompt."""
    if not trained.any():
        return trained
    end = len(trained) - int(np.argmax(trained[::-1]))
    start = end
    while start > 0 and trained[start - 1]:
        start -= 1
    out = np.zeros_like(trained)
    out[start:end] = True
    return out


class CompletionRows(Configurable):
    """What sources of prompts with completions to score share: each example is one prompt with
    a completion per side (``SIDES``), a row per side of ``seq_len`` positions under its field
    prefix (the module docstring: tokens, truncation, weights). A subclass reads its records
    into objects with ``prompt``, one attribute per side, ``conversational`` and ``where``, and
    sets ``self.tokenizer``, ``self.report`` and ``self.read_report``."""

    # The completions of an example, and the prefix of each one's row fields.
    SIDES: Tuple[str, ...] = SIDES
    FIELD_PREFIX: Dict[str, str] = {side: f"{side}_" for side in SIDES}
    # Whether every row of an example keeps the same prompt when long rows are cut (a pair's
    # two rows are compared); False: each row is cut by the rule on its own.
    SHARED_PROMPT = True
    # The sides without which an example is dropped when nothing of their completion is left
    # to score (the rest: kept with zero weights). None: every side.
    REQUIRED_SIDES: Optional[Tuple[str, ...]] = None

    class Config(RecordFilesConfig):
        # Tokens per row (every row of an example).
        seq_len: int = 128

        def _validate_values(self):
            if self.seq_len < 2:
                yield "seq_len", f"must be >= 2 (a prompt token and a completion token), got " \
                                 f"{self.seq_len}"
            yield from super()._validate_values()

    def _split_records(self, record_format: Any) -> List[Any]:
        return read_split(self.config, record_format=record_format, report=self.read_report)

    def __len__(self) -> int:
        return len(next(iter(self.rows.values())))

    def __getitem__(self, index: int) -> Dict[str, Any]:
        return {name: values[index] for name, values in self.rows.items()}

    def _tokens(self, pair: Any) -> Optional[Dict[str, Tuple[np.ndarray, np.ndarray]]]:
        """Per side, ``(tokens, scored)``: the ids and which of them are the completion's (the
        template's assistant tokens, for a conversation)."""
        tok = self.tokenizer
        if not pair.conversational:
            bos = [tok.bos_id] if tok.bos_id is not None else []
            eos = [tok.eos_id] if tok.eos_id is not None else []
            prompt = bos + tok.encode(pair.prompt).tolist()
            out = {}
            for side in self.SIDES:
                completion = tok.encode(getattr(pair, side)).tolist() + eos
                out[side] = (np.asarray(prompt + completion, np.int32),
                             np.asarray([False] * len(prompt) + [True] * len(completion)))
            return out
        out = {}
        for side in self.SIDES:
            try:
                tokens, trained = tok.encode_conversation(tuple(pair.prompt)
                                                          + tuple(getattr(pair, side)))
            except chat.TemplateError as e:
                bad_record(e, where=pair.where, on_bad_record=self.config.on_bad_record,
                           report=self.read_report)
                return None
            out[side] = (tokens, _last_span(trained))
        return out

    def _rows(self, pair: Any) -> Optional[Dict[str, np.ndarray]]:
        sides = self._tokens(pair)
        if sides is None:
            return None
        seq_len = self.config.seq_len
        budget = seq_len + 1  # Tokens a row of seq_len next-token pairs holds.
        # The prompt: what comes before a side's first scored token.
        starts = {side: int(np.argmax(scored)) if scored.any() else len(scored)
                  for side, (_, scored) in sides.items()}
        lengths = {side: len(tokens) - starts[side] for side, (tokens, _) in sides.items()}
        out: Dict[str, np.ndarray] = {}
        cut_any = False
        for side, (tokens, scored) in sides.items():
            kept = ([starts[side]], lengths[side]) if not self.SHARED_PROMPT else (
                list(starts.values()), max(lengths.values()))
            keep_prompt = min(max(kept[0]), max(budget - kept[1], budget // 2))
            drop = max(0, starts[side] - keep_prompt)  # The prompt's first tokens go first.
            tokens, scored = tokens[drop:][:budget], scored[drop:][:budget]
            cut = len(sides[side][0]) - len(tokens)
            if cut:
                cut_any = True
                self.report.truncated_tokens += cut
            weights = scored[1:].astype(np.float32)  # A target is scored when its token is.
            if not weights.any() and (self.REQUIRED_SIDES is None
                                      or side in self.REQUIRED_SIDES):
                self.report.dropped += 1
                return None
            for name, values in (("input_ids", tokens[:-1]), ("target_ids", tokens[1:]),
                                 ("weights", weights), ("valid", np.ones(len(tokens) - 1))):
                row = np.zeros(seq_len, np.int32 if name.endswith("ids") else np.float32)
                row[:len(values)] = values
                out[self.FIELD_PREFIX[side] + name] = row
        self.report.truncated += int(cut_any)
        if cut_any and len(sides) == 2 and all(
                np.array_equal(*(out[self.FIELD_PREFIX[side] + name] for side in sides))
                for name in ("input_ids", "weights")):
            self.report.same_when_cut.append(pair.where)  # (They differ only past the row.)
            return None
        return out


class PreferencePairs(CompletionRows):
    """Examples ``{"chosen_input_ids", "chosen_target_ids", "chosen_weights", "rejected_..."}``,
    each ``[seq_len]``, of tokenized preference pairs."""

    # What its rows are, for the objectives that read them (train/objective.py).
    READ_BY = "preference pairs"

    FIELDS = FIELDS

    class Config(CompletionRows.Config):
        # The record fields of the two completions.
        chosen_field: str = "chosen"
        rejected_field: str = "rejected"

    def __init__(self, cfg=None, *, tokenizer: Optional[Tokenizer] = None, **fields):
        """``tokenizer``: the input's (``Input.Config.tokenizer``); default bytes."""
        super().__init__(cfg, **fields)
        cfg = self.config
        if cfg.files is None:
            raise errors.DataError("preference pairs come from your files", path="files",
                                   suggestion="give globs of .jsonl files of {\"prompt\", "
                                              "\"chosen\", \"rejected\"} records")
        self.tokenizer = tokenizer or Tokenizer.default_config().instantiate()
        self.read_report, self.report = ReadReport(), PairReport(seq_len=cfg.seq_len)
        rows = [self._rows(pair) for pair in self._pairs()]
        rows = [r for r in rows if r is not None]
        if self.report.same_when_cut:
            same = self.report.same_when_cut
            raise errors.DataError(
                f"{len(same)} pair(s) of the {cfg.split} split differ only past seq_len="
                f"{cfg.seq_len} tokens (the first: {same[0]}): cut to a row, chosen and rejected "
                f"are the same and the pair teaches nothing", path="seq_len",
                suggestion="raise seq_len (and the model's max_seq_len with it), or shorten "
                           "the prompts")
        if not rows:
            raise errors.DataError(f"the {cfg.split} split has no pair ({self.report.text()})",
                                   path="files", suggestion="give more pairs or lower "
                                                            "held_out_fraction")
        self.rows = {name: np.stack([r[name] for r in rows]) for name in FIELDS}
        self.report.pairs = len(rows)
        log_split(cfg.split, self.read_report, self.report.text(),
                  lost=bool(self.report.truncated or self.report.dropped))

    @property
    def record_kind(self) -> str:
        return "preference"

    @classmethod
    def declare(cls, cfg: "PreferencePairs.Config", *, tokenizer: Tokenizer) -> Declared:
        """Both rows hold ids of the tokenizer, ``seq_len`` positions each."""
        return Declared.of_tokens(tokenizer, fields=tuple(
            f"{side}_{name}" for side in SIDES for name in ("input_ids", "target_ids")),
            length=cfg.seq_len)

    def _pairs(self) -> List[PreferencePair]:
        cfg = self.config
        return self._split_records(PreferenceFormat(prompt_field=cfg.prompt_field,
                                                    chosen_field=cfg.chosen_field,
                                                    rejected_field=cfg.rejected_field))
