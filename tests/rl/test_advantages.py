"""Group-relative advantages against the formulas written out with Python's statistics module:
a row's reward minus its group's mean over its group's (or the batch's) sample standard
deviation + 1e-4, or not divided (Dr. GRPO); abstained (NaN) rewards out of the means."""

import math
import statistics

import numpy as np
import pytest

from titanax.rl.advantages import group_advantages

REWARDS = [1.0, 0.0, 0.5, 1.0, 0.2, 0.2, 0.2, 0.2, 3.0, float("nan"), 1.0, 2.0]


def _expected(rewards, group, scale):
    out = []
    everything = [r for r in rewards if not math.isnan(r)]
    for start in range(0, len(rewards), group):
        members = [r for r in rewards[start:start + group] if not math.isnan(r)]
        mean = statistics.fmean(members)
        std = statistics.stdev(members) if scale == "group" else statistics.stdev(everything)
        for r in rewards[start:start + group]:
            if math.isnan(r):
                out.append(0.0)
            elif scale == "none":
                out.append(r - mean)
            else:
                out.append((r - mean) / (std + 1e-4))
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_follow_the_formulas(scale):
    got = group_advantages(np.array(REWARDS), num_generations=4, scale_rewards=scale)
    np.testing.assert_allclose(got.advantages, _expected(REWARDS, 4, scale), rtol=1e-12,
                               atol=1e-12)
    assert got.equal_group.tolist() == [False] * 4 + [True] * 4 + [False] * 4


def test_an_all_equal_group_has_no_advantage_and_is_marked():
    got = group_advantages(np.array([1.0, 1.0, 0.0, 1.0]), num_generations=2)
    assert got.advantages[:2].tolist() == [0.0, 0.0]
    assert got.equal_group.tolist() == [True, True, False, False]
    assert got.advantages[2] < 0 < got.advantages[3]
