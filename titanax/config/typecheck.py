"""Checking config values against field annotations.

AXLearn configs accept anything on assignment and fail much later, deep inside the constructor that
first uses the value. We check at assignment time instead (and again in ``validate()``, because a
list can be mutated in place after it was assigned), so the error points at the field.

The checker understands the annotations configs actually use: plain classes, ``int``/``float``
(an int is accepted where a float is expected, never a bool), ``Optional``/``Union``, ``Literal``,
``Sequence``/``list``/``tuple`` (homogeneous and fixed-length), ``dict``/``Mapping``,
``Callable``, ``type[X]``, ``Annotated`` and nested config classes. Annotations it cannot check
(protocols that are not runtime-checkable, TypeVars, exotic generics) are accepted rather than
guessed at.
"""

from __future__ import annotations

import collections.abc
import enum
import math
import sys
import types
import typing
from typing import Any, Optional, Tuple

from titanax.config.required import RequiredFieldValue

# A field annotation after forward references were resolved.
Annotation = Any


class _Unchecked:
    """Marker for annotations that could not be resolved; values are accepted as they are."""

    def __repr__(self) -> str:
        return "<unresolved annotation>"


UNCHECKED = _Unchecked()
# The largest finite float64 (an int beyond it is no float).
_LARGEST_FLOAT = sys.float_info.max

_SEQUENCE_ORIGINS = (collections.abc.Sequence, list, tuple, collections.abc.MutableSequence)
_MAPPING_ORIGINS = (dict, collections.abc.Mapping, collections.abc.MutableMapping)


def is_union(annotation: Annotation) -> bool:
    origin = typing.get_origin(annotation)
    return origin is typing.Union or origin is types.UnionType


def union_members(annotation: Annotation) -> Tuple[Annotation, ...]:
    return typing.get_args(annotation) if is_union(annotation) else (annotation,)


def strip_annotated(annotation: Annotation) -> Annotation:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def describe_type(annotation: Annotation) -> str:
    """A short human-readable name of an annotation, for error messages."""
    annotation = strip_annotated(annotation)
    if annotation is UNCHECKED or annotation is Any:
        return "Any"
    if annotation is type(None) or annotation is None:
        return "None"
    if is_union(annotation):
        members = [m for m in typing.get_args(annotation) if not _is_required_marker(m)]
        has_none = any(m is type(None) for m in members)
        rest = [m for m in members if m is not type(None)]
        inner = " | ".join(describe_type(m) for m in rest)
        return f"{inner} or None" if has_none else inner
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = typing.get_args(annotation)
        name = getattr(origin, "__name__", str(origin))
        if args:
            return f"{name}[{', '.join('...' if a is Ellipsis else describe_type(a) for a in args)}]"
        return name
    if isinstance(annotation, type):
        return annotation.__qualname__
    return str(annotation)


def _is_required_marker(annotation: Annotation) -> bool:
    return annotation is RequiredFieldValue


def coerce(value: Any, annotation: Annotation) -> Tuple[Any, Optional[str]]:
    """Checks ``value`` against ``annotation``.

    Returns ``(value_to_store, None)`` on success, where the stored value may be normalised (an int
    becomes a float for a ``float`` field; a list becomes a tuple for a ``tuple`` field), or
    ``(value, problem)`` where ``problem`` says what is wrong.
    """
    annotation = strip_annotated(annotation)
    if annotation is UNCHECKED or annotation is Any or annotation is object:
        return value, None
    if isinstance(annotation, typing.TypeVar):
        return value, None
    if annotation is None or annotation is type(None):
        return value, (None if value is None else f"expected None, got {_describe_value(value)}")
    if is_union(annotation):
        problems = []
        for member in typing.get_args(annotation):
            coerced, problem = coerce(value, member)
            if problem is None:
                return coerced, None
            problems.append(problem)
        return value, f"expected {describe_type(annotation)}, got {_describe_value(value)}"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        choices = typing.get_args(annotation)
        if value in choices and not (isinstance(value, bool) and not any(c is value for c in choices)):
            return value, None
        return value, f"expected {describe_type(annotation)}, got {value!r}"
    if origin is type:
        (bound,) = typing.get_args(annotation) or (object,)
        if isinstance(value, type) and (not isinstance(bound, type) or issubclass(value, bound)):
            return value, None
        return value, f"expected a subclass of {describe_type(bound)}, got {_describe_value(value)}"
    if origin in (collections.abc.Callable,) or annotation is collections.abc.Callable \
            or annotation is typing.Callable:
        if callable(value):
            return value, None
        return value, f"expected a callable, got {_describe_value(value)}"
    if origin in _SEQUENCE_ORIGINS:
        return _coerce_sequence(value, annotation, origin)
    if origin in _MAPPING_ORIGINS:
        return _coerce_mapping(value, annotation)
    if origin is not None:
        # Another generic (e.g. a user-defined Generic[T]); check the origin class only.
        return _coerce_plain(value, origin)
    return _coerce_plain(value, annotation)


def _coerce_plain(value: Any, cls: Any) -> Tuple[Any, Optional[str]]:
    if not isinstance(cls, type):
        return value, None  # A NewType, a string that could not be resolved, ...
    if cls is float:
        if isinstance(value, bool):
            return value, f"expected float, got bool {value!r}"
        if isinstance(value, int):
            if abs(value) > _LARGEST_FLOAT:
                return value, f"expected float, got {value}, beyond float64's range"
            return float(value), None
        if isinstance(value, float):
            if math.isnan(value):  # Never a setting: every comparison with it is False.
                return value, "expected a number, got nan"
            return value, None
        return value, f"expected float, got {_describe_value(value)}"
    if cls is int and isinstance(value, bool):
        return value, f"expected int, got bool {value!r}"
    if cls is int and isinstance(value, int) and not -2 ** 63 <= value < 2 ** 63:
        # numpy, jax and every file format Titanax writes hold 64-bit integers at most.
        return value, f"expected a 64-bit int, got {value}"
    if cls in (list, tuple) or cls in _SEQUENCE_ORIGINS:
        return _coerce_sequence(value, cls, cls)
    if cls in _MAPPING_ORIGINS:
        return _coerce_mapping(value, cls)
    try:
        ok = isinstance(value, cls)
    except TypeError:  # Protocols that are not runtime-checkable.
        return value, None
    if ok:
        return value, None
    return value, f"expected {describe_type(cls)}, got {_describe_value(value)}"


def _coerce_sequence(value: Any, annotation: Annotation, origin: Any) -> Tuple[Any, Optional[str]]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        return value, f"expected {describe_type(annotation)}, got {_describe_value(value)}"
    args = typing.get_args(annotation)
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            return value, (f"expected {describe_type(annotation)} with {len(args)} elements, "
                           f"got {len(value)}")
        element_types = list(args)
    else:
        element_types = [args[0] if args else Any] * len(value)
    out = []
    for index, (element, element_type) in enumerate(zip(value, element_types)):
        coerced, problem = coerce(element, element_type)
        if problem is not None:
            return value, f"element [{index}]: {problem}"
        out.append(coerced)
    if origin is list or origin is collections.abc.MutableSequence:
        return out, None
    if origin is tuple:
        return tuple(out), None
    return type(value)(out), None


def _coerce_mapping(value: Any, annotation: Annotation) -> Tuple[Any, Optional[str]]:
    if not isinstance(value, collections.abc.Mapping):
        return value, f"expected {describe_type(annotation)}, got {_describe_value(value)}"
    args = typing.get_args(annotation)
    key_type, value_type = args if len(args) == 2 else (Any, Any)
    out = {}
    for key, item in value.items():
        _, problem = coerce(key, key_type)
        if problem is not None:
            return value, f"key {key!r}: {problem}"
        coerced, problem = coerce(item, value_type)
        if problem is not None:
            return value, f"[{key!r}]: {problem}"
        out[key] = coerced
    return out, None


def _describe_value(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, type):
        return f"class {value.__qualname__}"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__qualname__} {text}"
