"""Group-relative advantages from the rollouts' rewards (on the host, over the global batch).

The completions of one prompt form a group (``num_generations`` consecutive rows). A row's
advantage is its reward minus its group's mean, divided (``scale_rewards``) by its group's
standard deviation (``"group"``), the whole batch's (``"batch"``) or not at all (``"none"``:
Dr. GRPO), plus 1e-4 -- TRL's formulas, Bessel-corrected standard deviations, a NaN reward
(every reward function abstained) out of the means and its advantage 0.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np

SCALES = ("group", "batch", "none")


class Advantages(NamedTuple):
    """Per row: its advantage, and whether its group's rewards are all equal (no signal)."""

    advantages: np.ndarray
    equal_group: np.ndarray


def _nanstd(values: np.ndarray, axis=None, keepdims=False) -> np.ndarray:
    count = np.sum(~np.isnan(values), axis=axis, keepdims=keepdims)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 1, np.sqrt(np.nanvar(values, axis=axis, keepdims=keepdims)
                                           * count / np.maximum(count - 1, 1)), np.nan)


def group_advantages(rewards: np.ndarray, *, num_generations: int,
                     scale_rewards: Literal["group", "batch", "none"] = "group") -> Advantages:
    """``rewards`` ``[rows]`` (groups of ``num_generations`` consecutive rows; NaN: unscored)."""
    if scale_rewards not in SCALES:
        raise ValueError(f"scale_rewards must be one of {SCALES}, got {scale_rewards!r}")
    rewards = np.asarray(rewards, np.float64)
    grouped = rewards.reshape(-1, num_generations)
    with np.errstate(invalid="ignore"):
        mean = np.repeat(np.nanmean(grouped, axis=1), num_generations)
    group_std = (np.repeat(_nanstd(grouped, axis=1), num_generations) if num_generations > 1
                 else np.zeros_like(rewards))
    if scale_rewards == "batch":
        std = np.full_like(rewards, _nanstd(rewards)) if rewards.size > 1 \
            else np.zeros_like(rewards)
    else:
        std = group_std
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    equal = np.isclose(np.nan_to_num(group_std, nan=0.0), 0.0)
    return Advantages(advantages=np.nan_to_num(advantages, nan=0.0), equal_group=equal)
