"""Rollout rows: a left-padded prompt and its sampled completion as one training row.

The row is ``prompt + completion`` (``P + T`` tokens, the prompt left-padded to ``P`` as the
sampler had it) shifted by one: ``input_ids`` / ``target_ids`` of ``P + T - 1`` positions. The
padding is segment 0 and every real token segment 1 (no real token attends to padding), and
positions count from the prompt's first real token -- as the sampler placed them, so the train
step recomputes the sampler's log-probs (``tests/rl/test_sampler_parity.py``). ``weights`` mark
the completion's targets up to and including its end token (``completion_mask``); ``old_logps``
hold the sampler's log-probs at those targets.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

# What a rollout row holds (per row; the first five [P + T - 1], the last two [rows]).
FIELDS = {"input_ids": "int32", "target_ids": "int32", "segment_ids": "int32",
          "positions": "int32", "weights": "float32", "old_logps": "float32",
          "advantages": "float32", "row_weights": "float32"}
# The fields with one value per row (the rest have one per target position).
PER_ROW = tuple(list(FIELDS)[-2:])


def rollout_rows(*, prompt_ids: np.ndarray, prompt_lengths: np.ndarray,
                 completion_ids: np.ndarray, completion_mask: np.ndarray,
                 old_logps: np.ndarray, advantages: np.ndarray,
                 row_weights: np.ndarray) -> Dict[str, np.ndarray]:
    """Training rows (see the module docstring) of ``[rows, P]`` left-padded prompts (their
    real lengths ``[rows]``) and ``[rows, T]`` completions."""
    rows, prompt = prompt_ids.shape
    tokens = np.concatenate([prompt_ids, completion_ids], axis=1).astype(np.int32)
    length = tokens.shape[1] - 1
    offsets = (prompt - np.asarray(prompt_lengths, np.int64))[:, None]
    places = np.arange(length)[None, :]
    weights = np.zeros((rows, length), np.float32)
    weights[:, prompt - 1:] = completion_mask
    logps = np.zeros((rows, length), np.float32)
    logps[:, prompt - 1:] = np.where(completion_mask > 0, old_logps, 0.0)
    return {"input_ids": tokens[:, :-1], "target_ids": tokens[:, 1:],
            "segment_ids": (places >= offsets).astype(np.int32),
            "positions": np.maximum(places - offsets, 0).astype(np.int32),
            "weights": weights, "old_logps": logps,
            "advantages": np.asarray(advantages, np.float32),
            "row_weights": np.asarray(row_weights, np.float32)}


def completion_mask(completion_ids: np.ndarray, end_ids) -> np.ndarray:
    """``[rows, T]`` float32: 1 up to and including each row's first end token (all of a row
    that has none: it ran out of budget)."""
    ended = np.isin(completion_ids, np.asarray(list(end_ids), np.int64))
    after = np.cumsum(ended, axis=1) - ended  # End tokens strictly before each place.
    return (after == 0).astype(np.float32)
