"""A file of prompts for ``titanax.generate --prompts_file``: one JSON object per line,
``{"prompt_ids": [...]}`` or ``{"prompt": "..."}`` (text: needs the model's tokenizer),
optionally with the line's own ``"max_new_tokens"`` (at most the command's).

Every line is checked against the model before anything is generated -- ids inside the
vocabulary, the prompt and its new tokens inside ``max_seq_len`` -- and a bad one is a
``LaunchFlagError`` naming ``--prompts_file`` and its line: a batch job that fails at line 900
after an hour of generation would lose the hour.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, List

from titanax import errors

FLAG = "--prompts_file"


@dataclasses.dataclass(frozen=True)
class PromptRequest:
    """One line's prompt: its token ids and how many tokens to generate after it at most."""

    ids: List[int]
    max_new_tokens: int


def read_prompts(path: str, *, encode: Callable[[str], List[int]], vocab_size: int,
                 max_new_tokens: int, max_seq_len: int) -> List[PromptRequest]:
    """The file's requests in order. ``encode``: a text prompt's ids (raises the tokenizer's
    ``LaunchFlagError`` when the model has none); ``max_new_tokens``: the command's limit."""
    if not os.path.isfile(path):
        raise errors.LaunchFlagError(f"no such file: {path}", path=FLAG,
                                     suggestion="a JSONL file, one {\"prompt_ids\": [...]} or "
                                                "{\"prompt\": \"...\"} per line")
    requests = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                requests.append(_request(line, f"{FLAG} line {number}", encode=encode,
                                         vocab_size=vocab_size, limit=max_new_tokens,
                                         max_seq_len=max_seq_len))
    if not requests:
        raise errors.LaunchFlagError(f"{path} holds no prompt", path=FLAG,
                                     suggestion="one JSON object per line")
    return requests


def _request(line: str, where: str, *, encode: Callable[[str], List[int]], vocab_size: int,
             limit: int, max_seq_len: int) -> PromptRequest:
    """One line's request (``limit``: the command's ``--max_new_tokens``)."""
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as e:
        raise errors.LaunchFlagError(f"is not JSON ({e.msg})", path=where,
                                     suggestion="one JSON object per line") from None
    if not isinstance(entry, dict) or ("prompt" in entry) == ("prompt_ids" in entry):
        raise errors.LaunchFlagError("needs exactly one of \"prompt\" and \"prompt_ids\"",
                                     path=where, suggestion="{\"prompt_ids\": [1, 2, 3]} or "
                                                            "{\"prompt\": \"text\"}")
    unknown = sorted(set(entry) - {"prompt", "prompt_ids", "max_new_tokens"})
    if unknown:
        raise errors.LaunchFlagError(f"has fields this command does not read: {unknown}",
                                     path=where, suggestion="prompt or prompt_ids, and "
                                                            "max_new_tokens")
    ids = _ids(entry, where, encode=encode, vocab_size=vocab_size)
    new_tokens = entry.get("max_new_tokens", limit)
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or not (
            1 <= new_tokens <= limit):
        raise errors.LaunchFlagError(f"max_new_tokens must be an integer in [1, {limit}] "
                                     f"(--max_new_tokens), got {new_tokens!r}", path=where,
                                     suggestion=f"at most --max_new_tokens={limit}")
    if len(ids) + new_tokens > max_seq_len:
        raise errors.LaunchFlagError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({new_tokens}) exceeds the model's "
            f"max_seq_len {max_seq_len}", path=where,
            suggestion="shorten the prompt or generate fewer tokens")
    return PromptRequest(ids=ids, max_new_tokens=new_tokens)


def _ids(entry: dict, where: str, *, encode: Callable[[str], List[int]],
         vocab_size: int) -> List[int]:
    if "prompt" in entry:
        if not isinstance(entry["prompt"], str):
            raise errors.LaunchFlagError("\"prompt\" must be a string", path=where,
                                         suggestion="or give \"prompt_ids\"")
        ids = encode(entry["prompt"])
    else:
        ids = entry["prompt_ids"]
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise errors.LaunchFlagError("\"prompt_ids\" must be a list of integers",
                                         path=where, suggestion="e.g. [1, 2, 3]")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if not ids or bad:
        raise errors.LaunchFlagError(
            f"ids must be in [0, {vocab_size}) (model.vocab_size)"
            + (f"; got {bad[:5]}" if bad else "; the prompt is empty"), path=where,
            suggestion="give ids of this model's vocabulary")
    return list(ids)
