"""Rewards: the built-ins on hand-made completions, yours by import path (called as TRL calls
its reward functions), and what is refused -- each naming the reward's config path."""

import sys
import textwrap

import numpy as np
import pytest

from titanax import errors
from titanax.rl.rewards import AnswerMatch, FormatMatch, LengthPenalty, RewardSet


def _call(reward_cfg, completions, *, budget=10, **fields):
    return reward_cfg.instantiate()(prompts=[""] * len(completions), completions=completions,
                                    completion_ids=[[0] * len(c) for c in completions],
                                    budget=budget, **fields)


def test_answer_match_numeric_takes_the_last_number():
    got = _call(AnswerMatch.default_config(),
                ["so 3 + 4 = 7", "7.0", "1,000", "no number", "77", "-2"],
                answer=["7", "7", "1000", "7", "7", "-2"])
    assert got == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]


def test_answer_match_exact_and_by_regex():
    assert _call(AnswerMatch.default_config().set(match="exact"), [" Paris ", "paris"],
                 answer=["Paris", "Paris"]) == [1.0, 0.0]
    boxed = AnswerMatch.default_config().set(extract=r"\\boxed\{([^}]*)\}")
    assert _call(boxed, [r"so \boxed{12}", "12", r"\boxed{1} then \boxed{13}"],
                 answer=["12", "12", "13"]) == [1.0, 0.0, 1.0]


def test_answer_match_names_a_missing_field():
    with pytest.raises(errors.RewardError, match="no field 'answer'.*solution"):
        _call(AnswerMatch.default_config(), ["1"], solution=["1"])


def test_format_and_length():
    fmt = FormatMatch.default_config().set(pattern=r"<think>.*</think>\s*<answer>.*</answer>")
    assert _call(fmt, ["<think>a\nb</think> <answer>3</answer>", "<answer>3</answer>"]) == \
        [1.0, 0.0]
    length = LengthPenalty.default_config().set(free_tokens=4)
    assert _call(length, ["ab", "abcd", "abcdefg", "abcdefghij"], budget=10) == \
        [0.0, 0.0, -0.5, -1.0]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def shouty(completions, **kwargs):
            return [float(c.isupper()) for c in completions]

        def by_answer(prompts, completions, completion_ids, answer, **kwargs):
            return [None if a == "skip" else float(c == a) for c, a in zip(completions, answer)]

        def wrong_length(completions, **kwargs):
            return [1.0]

        def not_a_number(completions, **kwargs):
            return ["yes"] * len(completions)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_rewards", None)


def test_user_functions_by_import_path_weighted_with_the_built_ins(user_module):
    rewards = RewardSet(functions=["my_rewards.shouty", "my_rewards:by_answer"],
                        weights=[0.5, 2.0],
                        rewards={"fmt": FormatMatch.default_config().set(pattern="[A-Z]+",
                                                                         weight=1.0)})
    assert rewards.names == ["shouty", "by_answer", "fmt"]
    scores = rewards.score(prompts=["p"] * 3, completions=["ABC", "abc", "X"],
                           completion_ids=[[1], [2], [3]],
                           fields={"answer": ["ABC", "skip", "no"]}, budget=4)
    np.testing.assert_array_equal(scores[:, 0], [1.0, 0.0, 1.0])
    assert scores[0, 1] == 1.0 and np.isnan(scores[1, 1]) and scores[2, 1] == 0.0
    np.testing.assert_array_equal(rewards.total(scores), [0.5 + 2.0 + 1.0, 0.0, 0.5 + 1.0])


@pytest.mark.parametrize("path,message", [
    ("my_rewards.nothing", "has no function 'nothing'"),
    ("no_such_module.fn", "cannot import 'no_such_module'"),
    ("justaname", "is no import path"),
])
def test_unimportable_functions_are_refused_by_config_path(user_module, path, message):
    with pytest.raises(errors.RewardError, match=message) as info:
        RewardSet(functions=["my_rewards.shouty", path], weights=None, rewards={})
    assert info.value.path == "objective.reward_functions[1]"


@pytest.mark.parametrize("name,message", [("wrong_length", "returned 1 values for 2"),
                                          ("not_a_number", "returned 'yes' for completion 0")])
def test_bad_returns_are_refused_naming_the_function(user_module, name, message):
    rewards = RewardSet(functions=[f"my_rewards.{name}"], weights=None, rewards={})
    with pytest.raises(errors.RewardError, match=message) as info:
        rewards.score(prompts=["p", "q"], completions=["a", "b"], completion_ids=[[1], [2]],
                      fields={}, budget=2)
    assert info.value.path == "objective.reward_functions[0]"
