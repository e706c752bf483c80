"""Small reusable checks of config values, for ``_validate_values`` hooks and ``checked_by``.

Each yields ``(field, problem)`` when the value is a plain number that breaks the rule, and
nothing for values it cannot judge (None where None is allowed, a config that builds the value).
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterator, Tuple

Problem = Tuple[str, str]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def at_least(field: str, value: Any, low: float, *, allow_none: bool = False,
             none_means: str = "") -> Iterator[Problem]:
    """``value >= low`` (a finite number)."""
    if value is None and allow_none:
        return
    if _number(value) and not (math.isfinite(value) and value >= low):
        yield field, (f"must be a finite number >= {low:g}"
                      + (f" (or None: {none_means})" if none_means else "") + f", got {value}")


def positive(field: str, value: Any) -> Iterator[Problem]:
    """``value > 0`` (a finite number)."""
    if _number(value) and not (math.isfinite(value) and value > 0):
        yield field, f"must be a finite number > 0, got {value}"


def fraction(field: str, value: Any, *, closed: bool = False, allow_none: bool = False
             ) -> Iterator[Problem]:
    """``0 <= value < 1`` (``closed``: ``<= 1``)."""
    if value is None and allow_none:
        return
    if _number(value) and not (0 <= value < 1 or closed and value == 1):
        yield field, f"must be in [0, 1{']' if closed else ')'}, got {value}"


def regexes(field: str, patterns: Any) -> Iterator[Problem]:
    """``patterns`` a list of regular expressions (a lone string is refused: it would be read as
    one pattern per character)."""
    if not isinstance(patterns, (list, tuple)):
        what = f"the string {patterns!r}" if isinstance(patterns, str) else repr(patterns)
        yield field, f"must be a list of regular expressions, got {what}"
        return
    for pattern in patterns:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as e:
            yield field, f"{pattern!r} is not a regular expression: {e}"
