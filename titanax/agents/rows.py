"""Episodes as training rows: the same fields as a GRPO rollout's (``rl/rows.py``), so the
GRPO family's loss trains on them unchanged.

Each episode's ids (``Trajectory``) are one row, left-padded to the batch's length and shifted
by one (``input_ids`` / ``target_ids``). ``weights`` mark the targets the model sampled -- its
turns, end tokens included -- and nothing the template or the environment wrote, so a tool's
or a user's tokens get no gradient and no KL; ``old_logps`` hold the sampler's log-probs at
those targets. A one-turn episode's row is exactly GRPO's row of the same prompt and completion
(``tests/agents/test_rows.py``).
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

import numpy as np

from titanax.rl.rows import FIELDS


def episode_rows(episodes: Sequence[Tuple[np.ndarray, np.ndarray, np.ndarray]], *,
                 length: int, advantages: np.ndarray,
                 row_weights: np.ndarray) -> Dict[str, np.ndarray]:
    """Rows of ``episodes`` (each ``Trajectory.arrays()``: ids, trained, logps) of ``length``
    tokens each (``length - 1`` positions), left-padded; ``advantages`` and ``row_weights``
    per episode."""
    rows = len(episodes)
    tokens = np.zeros((rows, length), np.int32)
    trained = np.zeros((rows, length), bool)
    logps = np.zeros((rows, length), np.float32)
    offsets = np.zeros((rows, 1), np.int64)
    for row, (ids, mask, sampled) in enumerate(episodes):
        if len(ids) > length:
            raise ValueError(f"episode {row} holds {len(ids)} tokens, more than the rows' "
                             f"{length}")
        start = length - len(ids)
        tokens[row, start:], trained[row, start:], logps[row, start:] = ids, mask, sampled
        offsets[row] = start
    places = np.arange(length - 1)[None, :]
    out = {"input_ids": tokens[:, :-1], "target_ids": tokens[:, 1:],
           "segment_ids": (places >= offsets).astype(np.int32),
           "positions": np.maximum(places - offsets, 0).astype(np.int32),
           "weights": trained[:, 1:].astype(np.float32),
           "old_logps": np.where(trained[:, 1:], logps[:, 1:], 0.0).astype(np.float32),
           "advantages": np.asarray(advantages, np.float32),
           "row_weights": np.asarray(row_weights, np.float32)}
    return {name: out[name].astype(dtype) for name, dtype in FIELDS.items()}
