"""How config values print in ``debug_string()`` and serialise to JSON.

The text must be stable across processes and machines, because golden dumps of every experiment are
compared byte for byte: functions and classes print as their import path, never as a memory address.
"""

from __future__ import annotations

import enum
import functools
import math
from typing import Any

from titanax.config.required import RequiredFieldValue


def qualified_name(obj: Any) -> str:
    """``module.QualName`` of a function or class, e.g. ``optax._src.alias.adamw``."""
    module = getattr(obj, "__module__", None) or "<unknown>"
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__
    return f"{module}.{name}"


def format_value(value: Any) -> str:
    """One-line text of a leaf value."""
    if isinstance(value, RequiredFieldValue):
        return "REQUIRED"
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f"float({str(value)!r})"
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        if isinstance(value, functools.partial):
            return _format_partial(value)
        return qualified_name(value)
    if isinstance(value, functools.partial):
        return _format_partial(value)
    if isinstance(value, tuple):
        inner = ", ".join(format_value(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{format_value(k)}: {format_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(format_value(v) for v in value)) + "}"
    text = repr(value)
    if " at 0x" in text:
        return f"<{qualified_name(type(value))}>"
    return text


def _format_partial(value: functools.partial) -> str:
    parts = [format_value(value.func)]
    parts += [format_value(a) for a in value.args]
    parts += [f"{k}={format_value(v)}" for k, v in value.keywords.items()]
    return f"functools.partial({', '.join(parts)})"


def json_value(value: Any) -> Any:
    """A JSON-serialisable form of a leaf value (lossy for functions and objects)."""
    if isinstance(value, RequiredFieldValue):
        return "REQUIRED"
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    return format_value(value)
