"""One rollout as made: the updates it feeds and what its shown samples need -- and its form in a
checkpoint, for a rollout sampled ahead (asynchronous GRPO, ``max_staleness`` > 0) that a run
saved before training on it.

Why saved whole: a rollout sampled ahead was drawn with params the checkpoint no longer holds
(the ones of a step or more before), so a resumed run could not draw it again; it keeps the
rollout itself, every array bit for bit (its bytes, base64), so the resumed run trains on what
the uninterrupted run trained on.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any, Dict, List, Tuple

import numpy as np

# One update: (train rows, host metrics, completion tokens trained on over the whole batch).
Update = Tuple[Dict[str, np.ndarray], Dict[str, float], float]


@dataclasses.dataclass
class Rollout:
    """A rollout's updates (``updates_per_rollout x iterations`` of them) and, for the samples
    shown when it is trained on, its rows' prompts (left-padded, their lengths), completions
    (ids, and texts where they were decoded) and per-reward scores."""

    updates: List[Update]
    prompt_ids: np.ndarray
    lengths: np.ndarray
    completion_ids: List[List[int]]
    texts: List[str]
    per_reward: np.ndarray

    def to_json(self) -> Dict[str, Any]:
        return {"updates": [{"rows": {k: _array_to_json(v) for k, v in rows.items()},
                             "metrics": {k: float(v) for k, v in metrics.items()},
                             "trained": float(trained)} for rows, metrics, trained in
                            self.updates],
                "prompt_ids": _array_to_json(self.prompt_ids),
                "lengths": _array_to_json(self.lengths),
                "completion_ids": [list(map(int, ids)) for ids in self.completion_ids],
                "texts": list(self.texts), "per_reward": _array_to_json(self.per_reward)}

    @classmethod
    def from_json(cls, saved: Dict[str, Any]) -> "Rollout":
        return cls(updates=[({k: _array_from_json(v) for k, v in u["rows"].items()},
                             dict(u["metrics"]), float(u["trained"])) for u in saved["updates"]],
                   prompt_ids=_array_from_json(saved["prompt_ids"]),
                   lengths=_array_from_json(saved["lengths"]),
                   completion_ids=[list(ids) for ids in saved["completion_ids"]],
                   texts=list(saved["texts"]), per_reward=_array_from_json(saved["per_reward"]))


def _array_to_json(array: np.ndarray) -> Dict[str, Any]:
    array = np.ascontiguousarray(array)
    return {"dtype": array.dtype.str, "shape": list(array.shape),
            "bytes": base64.b64encode(array.tobytes()).decode("ascii")}


def _array_from_json(saved: Dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(saved["bytes"]), dtype=np.dtype(saved["dtype"])) \
        .reshape(saved["shape"]).copy()
