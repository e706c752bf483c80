"""Episodes as training rows (titanax/agents/rows.py): a one-turn episode's row is GRPO's row
of the same prompt and completion (rl/rows.py, written independently); in a multi-turn
episode only the sampled tokens are targets, with their log-probs."""

import numpy as np
import pytest

from titanax.agents.rows import episode_rows
from titanax.rl.rows import completion_mask, rollout_rows

END = 9


def test_a_one_turn_episode_is_grpos_row():
    prompts = [[3, 4, 5], [6, 7]]
    completions = [[11, 12, END, END], [13, 14, 15, 16]]  # (One ended; one ran out.)
    logps = np.asarray([[-0.1, -0.2, -0.3, -9.0], [-0.4, -0.5, -0.6, -0.7]], np.float32)
    width = 3
    padded = np.asarray([[0] * (width - len(p)) + p for p in prompts])
    mask = completion_mask(np.asarray(completions), [END])
    want = rollout_rows(prompt_ids=padded, prompt_lengths=np.asarray([3, 2]),
                        completion_ids=np.asarray(completions), completion_mask=mask,
                        old_logps=logps, advantages=np.asarray([1.0, -1.0]),
                        row_weights=np.ones(2))
    episodes = []
    for prompt, completion, m, lp in zip(prompts, completions, mask, logps):
        kept = int(m.sum())
        ids = np.asarray(prompt + completion[:kept] + [END] * (len(completion) - kept))
        trained = np.asarray([False] * len(prompt) + [True] * kept
                             + [False] * (len(completion) - kept))
        sampled = np.concatenate([np.zeros(len(prompt)), lp[:kept],
                                  np.zeros(len(completion) - kept)])
        episodes.append((ids, trained, sampled))
    got = episode_rows(episodes, length=width + 4, advantages=np.asarray([1.0, -1.0]),
                       row_weights=np.ones(2))
    # (GRPO's rows fill a finished completion with its end id; its weights stop at the first.)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_only_the_sampled_tokens_of_a_multi_turn_episode_are_targets():
    ids = np.asarray([1, 2, 20, 21, END, 3, 4, 22, END])
    trained = np.asarray([0, 0, 1, 1, 1, 0, 0, 1, 1], bool)
    logps = np.where(trained, -np.arange(1, 10) / 10, 0.0)
    rows = episode_rows([(ids, trained, logps)], length=11, advantages=np.asarray([0.5]),
                        row_weights=np.asarray([1.0]))
    assert rows["target_ids"][0].tolist() == [0, 1, 2, 20, 21, END, 3, 4, 22, END]
    assert rows["weights"][0].tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    np.testing.assert_allclose(rows["old_logps"][0][rows["weights"][0] > 0],
                               [-0.3, -0.4, -0.5, -0.8, -0.9], rtol=1e-6)
    assert rows["segment_ids"][0].tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]
    assert rows["positions"][0].tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="holds 9 tokens, more than the rows' 8"):
        episode_rows([(ids, trained, logps)], length=8, advantages=np.zeros(1),
                     row_weights=np.ones(1))
