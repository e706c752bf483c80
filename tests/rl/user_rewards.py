"""Reward functions a user might write wrongly, for the launcher's bad-input cases
(tests/test_launch_errors.py): one whose signature needs a record field the prompts lack
(refused before step 1), one that reads a missing field from its keyword arguments (seen only
when called: the error names the function and the records)."""


def needs_solution(prompts, completions, solution, **kwargs):
    """Reads a ``solution`` field: the bundled prompts have ``answer`` instead."""
    del prompts, kwargs
    return [float(c.strip() == s) for c, s in zip(completions, solution)]


def reads_difficulty(prompts, completions, **kwargs):
    """Reads ``kwargs["difficulty"]``, a field no bundled prompt has: a KeyError when called."""
    del prompts
    return [float(d) for d in kwargs["difficulty"]][:len(completions)]
