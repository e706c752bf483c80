"""Rewards: how each completion is scored, on the host, from its text.

A reward is called as TRL calls its reward functions -- ``reward(prompts=[...],
completions=[...], completion_ids=[...], **fields)`` with one entry per completion, ``fields``
the prompt records' other fields (``answer`` ...), each a list -- and returns one float per
completion (or None: it abstains; a completion every reward abstains on gets advantage 0).
A TRL reward function works unchanged. Several rewards are summed with their weights.

Yours are named by import path (``--config.objective.reward_functions="['my_rewards.correct']"``);
the built-ins are configs under ``--config.objective.rewards``:

- ``AnswerMatch``: the answer the completion gives (by ``extract``, a regex whose first group is
  the answer; by default the last number for ``numeric``, the whole stripped text for
  ``exact``) against the record's ``answer_field``: 1 if equal (numerically within
  ``tolerance``), else 0;
- ``FormatMatch``: 1 if the completion matches ``pattern`` (a regex, the whole text), else 0;
- ``LengthPenalty``: 0 up to ``free_tokens`` tokens, falling linearly to -1 at the token budget.
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence

import numpy as np

from titanax import errors
from titanax.utils.import_path import import_object
from titanax.config import Configurable, REQUIRED, Required

NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"


class Reward(Configurable):
    """One reward: ``__call__(prompts=, completions=, completion_ids=, **fields)`` -> floats."""

    class Config(Configurable.Config):
        # Its weight in the summed reward.
        weight: float = 1.0

        def _validate_values(self):
            if not math.isfinite(self.weight):
                yield "weight", f"must be finite, got {self.weight}"

    def __call__(self, *, prompts: List[Any], completions: List[str],
                 completion_ids: List[List[int]], budget: int = 0,
                 **fields: List[Any]) -> List[Optional[float]]:
        raise NotImplementedError


class AnswerMatch(Reward):
    """1 where the completion's answer equals the record's (see the module docstring)."""

    class Config(Reward.Config):
        # The prompt record's field holding the right answer.
        answer_field: str = "answer"
        # "numeric": both read as numbers (commas dropped), equal within tolerance;
        # "exact": equal strings after stripping whitespace.
        match: Literal["exact", "numeric"] = "numeric"
        # A regex whose first group is the completion's answer (the last match counts); None:
        # the last number (numeric), the whole text (exact).
        extract: Optional[str] = None
        # Numeric match: |given - answer| <= tolerance x max(1, |answer|).
        tolerance: float = 1e-6

        def _validate_values(self):
            yield from super()._validate_values()
            if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
                yield "tolerance", f"must be a finite number >= 0, got {self.tolerance}"
            if self.extract is not None:
                try:
                    if re.compile(self.extract).groups < 1:
                        yield "extract", "needs a group: (...) around the answer"
                except re.error as e:
                    yield "extract", f"is not a regex: {e}"

    def _given(self, text: str) -> Optional[str]:
        cfg = self.config
        if cfg.extract is not None:
            found = re.findall(cfg.extract, text, flags=re.DOTALL)
            if not found:
                return None
            last = found[-1]
            return last[0] if isinstance(last, tuple) else last
        if cfg.match == "exact":
            return text
        numbers = re.findall(NUMBER, text)
        return numbers[-1] if numbers else None

    def __call__(self, *, completions, **fields):
        cfg = self.config
        answers = fields.get(cfg.answer_field)
        if answers is None:
            have = sorted(k for k in fields if k not in ("prompts", "completion_ids", "budget"))
            raise errors.RewardError(
                f"the prompt records have no field {cfg.answer_field!r} (they have "
                f"{', '.join(have) or 'none'})", path="answer_field",
                suggestion="name the field holding the right answer")
        out = []
        for text, answer in zip(completions, answers):
            given = self._given(text)
            out.append(0.0 if given is None else float(self._equal(given, str(answer))))
        return out

    def _equal(self, given: str, answer: str) -> bool:
        if self.config.match == "exact":
            return given.strip() == answer.strip()
        a, b = _number(given), _number(answer)
        return a is not None and b is not None and \
            abs(a - b) <= self.config.tolerance * max(1.0, abs(b))


def _number(text: str) -> Optional[float]:
    try:
        return float(text.strip().replace(",", ""))
    except ValueError:
        return None


class FormatMatch(Reward):
    """1 where the whole completion matches ``pattern``."""

    class Config(Reward.Config):
        # A regex the whole completion must match (re.DOTALL: "." spans lines).
        pattern: Required[str] = REQUIRED

        def _validate_values(self):
            yield from super()._validate_values()
            if isinstance(self.pattern, str):
                try:
                    re.compile(self.pattern)
                except re.error as e:
                    yield "pattern", f"is not a regex: {e}"

    def __call__(self, *, completions, **fields):
        pattern = re.compile(self.config.pattern, flags=re.DOTALL)
        return [float(pattern.fullmatch(text) is not None) for text in completions]


class LengthPenalty(Reward):
    """0 up to ``free_tokens`` completion tokens, then linearly down to -1 at the budget."""

    class Config(Reward.Config):
        # Tokens a completion may use without penalty.
        free_tokens: int = 0

        def _validate_values(self):
            yield from super()._validate_values()
            if self.free_tokens < 0:
                yield "free_tokens", f"must be >= 0, got {self.free_tokens}"

    def __call__(self, *, completion_ids, budget: int = 0, **fields):
        free = self.config.free_tokens
        span = max(1, budget - free)
        return [-min(1.0, max(0, len(ids) - free) / span) for ids in completion_ids]


def import_function(path: str, *, where: str) -> Callable:
    """The callable at ``path`` (``package.module.name`` or ``package.module:name``)."""
    function = import_object(path, where=where, what="function", error=errors.RewardError)
    if not callable(function):
        raise errors.RewardError(f"{path!r} is a {type(function).__name__}, not a function",
                                 path=where, suggestion="name a function")
    return function


class RewardSet:
    """The run's rewards, named, weighted, called together (``score``)."""

    def __init__(self, *, functions: Sequence[str], weights: Optional[Sequence[float]],
                 rewards: Dict[str, Reward.Config], where: str = "objective"):
        self.names: List[str] = []
        self.calls: List[Callable] = []
        self.paths: List[str] = []
        weights = list(weights) if weights is not None else [1.0] * len(functions)
        self.weights: List[float] = []
        for index, path in enumerate(functions):
            at = f"{where}.reward_functions[{index}]"
            function = import_function(path, where=at)
            name = getattr(function, "__name__", path.replace(":", ".").rsplit(".", 1)[-1])
            self._add(name, function, weights[index], at)
        for name, cfg in rewards.items():
            self._add(name, cfg.instantiate(), cfg.weight, f"{where}.rewards[{name!r}]")

    def _add(self, name: str, call: Callable, weight: float, where: str) -> None:
        if name in self.names:
            name = f"{name}_{len(self.names)}"
        self.names.append(name)
        self.calls.append(call)
        self.weights.append(float(weight))
        self.paths.append(where)

    def check_fields(self, available: Sequence[str], *, source: str) -> None:
        """Before step 1: every argument a reward function requires (no default) is one it is
        given -- ``prompts``, ``completions``, ``completion_ids`` or a field of the prompt
        records (``available``, read from ``source``)."""
        given = set(available) | {"prompts", "completions", "completion_ids"}
        for call, where in zip(self.calls, self.paths):
            if isinstance(call, Reward):
                continue
            try:
                parameters = inspect.signature(call).parameters.values()
            except (TypeError, ValueError):
                continue
            needed = [p.name for p in parameters if p.default is inspect.Parameter.empty
                      and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            missing = [name for name in needed if name not in given]
            if missing:
                fields = ", ".join(sorted(available)) or "none"
                raise errors.RewardError(
                    f"{getattr(call, '__name__', call)} needs the record field(s) "
                    f"{', '.join(missing)}, which no record of {source} has (their fields: "
                    f"{fields})", path=where,
                    suggestion="add the field to the records, or give the argument a default")

    def score(self, *, prompts: List[Any], completions: List[str],
              completion_ids: List[List[int]], fields: Dict[str, List[Any]],
              budget: int, records: Optional[Sequence[str]] = None) -> np.ndarray:
        """``[completions, rewards]`` float64, NaN where a reward abstained; ``records``: where
        each completion's prompt came from (named when a function raises)."""
        out = np.full((len(completions), len(self.calls)), np.nan)
        for column, (call, where) in enumerate(zip(self.calls, self.paths)):
            kwargs = dict(fields, prompts=prompts, completions=completions,
                          completion_ids=completion_ids)
            if isinstance(call, Reward):
                kwargs["budget"] = budget
            try:
                values = call(**kwargs)
            except errors.TitanaxError as e:
                raise errors.RewardError(e.message, path=f"{where}.{e.path}" if e.path else where,
                                         suggestion=e.suggestion) from None
            except Exception as e:  # pylint: disable=broad-except  (the user's function)
                others = len(set(records)) - 1
                rows = (f"the completions of {records[0]}" + (
                    f" and {others} other record(s)" if others > 0 else "")
                    if records else f"{len(completions)} completions")
                raise errors.RewardError(
                    f"{getattr(call, '__name__', call)} raised {type(e).__name__}: {e} (scoring "
                    f"{rows})", path=where,
                    suggestion="fix the function (called as TRL calls one: prompts=, "
                               "completions=, completion_ids= and each record field by "
                               "name), or run with --show_traceback to see where") from e
            values = list(values) if values is not None else None
            if values is None or len(values) != len(completions):
                raise errors.RewardError(
                    f"returned {'None' if values is None else len(values)} values for "
                    f"{len(completions)} completions", path=where,
                    suggestion="return one float (or None) per completion, in order")
            for row, value in enumerate(values):
                if value is None:
                    continue
                try:
                    number = float(value)
                except (TypeError, ValueError):
                    raise errors.RewardError(
                        f"returned {value!r} for completion {row}", path=where,
                        suggestion="return floats (or None to abstain)") from None
                if not math.isfinite(number):
                    raise errors.RewardError(
                        f"returned {number} for completion {row}", path=where,
                        suggestion="return finite floats (or None to abstain)")
                out[row, column] = number
        return out

    def total(self, per_reward: np.ndarray) -> np.ndarray:
        """Weighted sum per completion (NaN where every reward abstained)."""
        weighted = per_reward * np.asarray(self.weights)[None, :]
        total = np.nansum(weighted, axis=1)
        total[np.isnan(per_reward).all(axis=1)] = np.nan
        return total
