"""Rollout rows: where a left-padded prompt and its completion land in a training row."""

import numpy as np

from titanax.rl.rows import completion_mask, rollout_rows


def test_completions_end_at_their_first_end_token():
    ids = np.array([[5, 2, 7, 2], [5, 6, 7, 8], [2, 2, 2, 2]])
    np.testing.assert_array_equal(completion_mask(ids, [2]),
                                  [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])


def test_a_row_is_the_prompt_then_the_completion_shifted_by_one():
    rows = rollout_rows(prompt_ids=np.array([[0, 0, 3, 4], [1, 2, 3, 4]]),
                        prompt_lengths=np.array([2, 4]),
                        completion_ids=np.array([[7, 8, 9], [5, 6, 2]]),
                        completion_mask=np.array([[1, 1, 1], [1, 1, 0]], np.float32),
                        old_logps=np.full((2, 3), -0.5), advantages=np.array([1.0, -1.0]),
                        row_weights=np.array([1.0, 0.0]))
    np.testing.assert_array_equal(rows["input_ids"], [[0, 0, 3, 4, 7, 8], [1, 2, 3, 4, 5, 6]])
    np.testing.assert_array_equal(rows["target_ids"], [[0, 3, 4, 7, 8, 9], [2, 3, 4, 5, 6, 2]])
    np.testing.assert_array_equal(rows["segment_ids"], [[0, 0, 1, 1, 1, 1], [1] * 6])
    np.testing.assert_array_equal(rows["positions"], [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(rows["weights"], [[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 0]])
    np.testing.assert_array_equal(rows["old_logps"], [[0, 0, 0, -.5, -.5, -.5],
                                                      [0, 0, 0, -.5, -.5, 0]])
    assert rows["advantages"].tolist() == [1.0, -1.0]
    assert rows["row_weights"].tolist() == [1.0, 0.0]
