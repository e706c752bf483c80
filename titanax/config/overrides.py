"""Command-line overrides: ``--config.learner.optimizer.learning_rate=1e-3``.

The syntax is ml_collections' (``--config.<path>=<value>``); parsing is ours, because the tree is a
Titanax config rather than a ConfigDict and because the value is parsed *for the field it lands in*:
the text ``"3"`` becomes ``3`` for an int field, ``3.0`` for a float field and ``"3"`` for a string
field; ``None`` is accepted only where the annotation allows it. Every bad override of a command
line is reported at once, each naming its path, the expected type and the valid fields.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import importlib
import sys
import typing
from typing import Any, Dict, List, Sequence, Tuple

from titanax import errors
from titanax.config import formatting, paths, typecheck
from titanax.config.base import ConfigBase, InstantiableConfig

FLAG_PREFIX = "--config."

# Config paths that moved, by their first part: old -> new. A command line written for the old
# tree is refused naming the new path (wave 5 moved every objective's fields under ``objective``:
# train/objective.py).
MOVED_PATHS = {
    "preference": "objective",
    "grpo": "objective",
    "reference_from": "objective.reference_from",
}


def moved_path(path: str) -> str:
    """Where ``path`` lives now (``path`` itself when it did not move)."""
    head, dot, rest = path.partition(".")
    head_name = head.split("[", 1)[0]
    if head_name not in MOVED_PATHS:
        return path
    return MOVED_PATHS[head_name] + head[len(head_name):] + (dot + rest if dot else "")


@dataclasses.dataclass(frozen=True)
class Override:
    """One ``path=value`` override as written on the command line."""

    path: str
    text: str

    def __str__(self) -> str:
        return f"{FLAG_PREFIX}{self.path}={self.text}"


def split_override_args(argv: Sequence[str]) -> Tuple[List[str], List[Override]]:
    """Separates ``--config.a.b=v`` arguments from the rest of ``argv``.

    ``--config.a.b v`` (value as the next argument) is accepted too, and a bare ``--config.flag``
    means ``true`` (for bool fields).
    """
    rest: List[str] = []
    overrides: List[Override] = []
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg.startswith(FLAG_PREFIX):
            body = arg[len(FLAG_PREFIX):]
            if "=" in body:
                path, text = body.split("=", 1)
            elif index + 1 < len(argv) and not argv[index + 1].startswith("--"):
                path, text = body, argv[index + 1]
                index += 1
            else:
                path, text = body, "true"
            overrides.append(Override(path=path, text=text))
        else:
            rest.append(arg)
        index += 1
    return rest, overrides


def apply_overrides(cfg: ConfigBase, overrides: Sequence[Override], *,
                    prefix: str = "config") -> ConfigBase:
    """Applies every override to ``cfg`` in order; raises one error listing all that failed."""
    problems: List[errors.TitanaxError] = []
    for override in overrides:
        try:
            apply_override(cfg, override)
        except errors.ConfigError as e:
            problems.append(type(e)(e.message, path=f"{prefix}.{e.path}" if e.path else prefix,
                                    suggestion=e.suggestion))
    if problems:
        raise errors.ConfigValidationError(problems, what="command-line overrides")
    return cfg


def apply_override(cfg: ConfigBase, override: Override) -> None:
    """Parses ``override.text`` for the field at ``override.path`` and sets it.

    Optional parts of the tree switch on and off from the command line, as Lingvo / AXLearn users
    expect: setting a field below an ``Optional[X.Config]`` field that is None first puts X's
    default config there (``--config.plan.zero.stage=1`` turns ZeRO on), and ``=None`` on such a
    field switches it off again. A nested config is also replaced by a plain value its field
    admits (``--config.learner.optimizer.learning_rate=1e-3`` replaces a schedule by a constant).
    """
    moved = moved_path(override.path)
    if moved != override.path and \
            override.path.split(".", 1)[0].split("[", 1)[0] not in type(cfg).__fields__:
        raise errors.ConfigError(f"has moved to {FLAG_PREFIX}{moved}", path=override.path,
                                 suggestion=f"write {FLAG_PREFIX}{moved}={override.text}")
    tokens = paths.parse_path(override.path)
    where = paths.format_path(tokens)
    _create_optional_parents(cfg, tokens)
    annotation = _annotation_at(cfg, tokens)
    current = cfg.get_recursively(tokens)
    if isinstance(current, ConfigBase):
        value, problem = _parse(override.text, typecheck.strip_annotated(annotation))
        if problem is None and not isinstance(value, ConfigBase) and \
                not _is_text_fallback(value, override.text):
            cfg.set_recursively(tokens, value)
            return
        fields = ", ".join(f for f in current.fields() if f not in ("klass", "fn"))
        raise errors.ConfigTypeError(
            f"is a nested {type(current).__qualname__}; it cannot be replaced by "
            f"{override.text!r}", path=where,
            suggestion=f"override its fields instead: {where}.<field> with one of {fields}")
    if _is_bare_none(override.text) and not _admits_none(annotation):
        raise errors.ConfigTypeError(
            "cannot be None", path=where, suggestion=_none_suggestion(cfg, tokens))
    value = parse_value(override.text, annotation, path=where)
    cfg.set_recursively(tokens, value)


def holds_config(cfg: ConfigBase, path: str) -> bool:
    """Whether the field at ``path`` is (or may be switched on as) a nested config, so that a
    mapping for it means its fields rather than a value (``--config_file`` entries)."""
    try:
        tokens = paths.parse_path(path)
        _create_optional_parents(cfg, tokens)  # (The caller's copy: optional parts switched on.)
        if isinstance(cfg.get_recursively(tokens), ConfigBase):
            return True
        annotation = typecheck.strip_annotated(_annotation_at(cfg, tokens))
    except (errors.TitanaxError, AttributeError, KeyError, IndexError, TypeError):
        return False
    members = typecheck.union_members(annotation) if typecheck.is_union(annotation) \
        else (annotation,)
    return any(_is_config_type(m) for m in members)


def config_dict_at(cfg: ConfigBase, path: str) -> bool:
    """Whether the field at ``path`` is a dict of configs (e.g. ``evalers``): a mapping for it
    names its entries, each a config (``evalers['heldout'].every_n_steps``)."""
    try:
        value = cfg.get_recursively(paths.parse_path(path))
    except (errors.TitanaxError, AttributeError, KeyError, IndexError, TypeError):
        return False
    return isinstance(value, dict) and bool(value) and all(
        isinstance(v, ConfigBase) for v in value.values())


def _is_bare_none(text: str) -> bool:
    return text.strip().lower() in _NONE


def _admits_none(annotation: Any) -> bool:
    annotation = typecheck.strip_annotated(annotation)
    return annotation in (typing.Any, typecheck.UNCHECKED) or any(
        m is type(None) for m in typecheck.union_members(annotation))


def _is_text_fallback(value: Any, text: str) -> bool:
    """True when ``value`` is only the raw text, accepted by a str (or Any) member."""
    return isinstance(value, str) and value == _unquote(text)


def _none_suggestion(cfg: ConfigBase, tokens: List[paths.PathToken]) -> str:
    """Where None is not allowed: how to switch the enclosing optional part off instead."""
    for depth in range(len(tokens) - 1, 0, -1):
        owner_tokens = tokens[:depth]
        if isinstance(owner_tokens[-1], str) and _admits_none(_annotation_at(cfg, owner_tokens)):
            return (f"to switch {paths.format_path(owner_tokens)} off, pass "
                    f"{FLAG_PREFIX}{paths.format_path(owner_tokens)}=None; for the text "
                    f"'None' write it quoted: \"'None'\"")
    return "give a value of type " + typecheck.describe_type(_annotation_at(cfg, tokens))


def _create_optional_parents(cfg: ConfigBase, tokens: List[paths.PathToken]) -> None:
    """Puts the default config into every None ``Optional[X.Config]`` field along the path, and
    a new entry into a dict of configs whose owner names the kind for that key
    (``new_entries``: ``evalers['lm_eval']`` starts an lm-eval evaler)."""
    node: Any = cfg
    owner: Any = None
    for index, token in enumerate(tokens[:-1]):
        if isinstance(node, dict) and isinstance(token, paths.Key) and owner is not None:
            if token.value not in node:
                _add_new_entry(owner, tokens[index - 1], token.value,
                               where=paths.format_path(tokens[:index + 1]))
            node, owner = getattr(owner, tokens[index - 1])[token.value], None
            continue
        if not isinstance(token, str) or not isinstance(node, ConfigBase) or \
                token not in type(node).__fields__:
            return
        owner = node
        value = getattr(node, token)
        if value is None:
            default = _default_config_for(type(node).field_annotation(token))
            if default is None:
                return
            setattr(node, token, default)
            value = getattr(node, token)
        node = value


def _add_new_entry(owner: ConfigBase, field: str, key: Any, *, where: str) -> None:
    """``owner.<field>[key]``: the default config of the kind ``owner`` names for that key
    (``Config.new_entries``); the keys it has and the ones it could make named otherwise."""
    kinds = getattr(type(owner), "new_entries", {}).get(field, {})
    if key not in kinds:
        existing = ", ".join(repr(k) for k in getattr(owner, field)) or "(none)"
        creatable = "; new entries: " + ", ".join(
            f"{k!r} ({path.rsplit('.', 1)[-1]})" for k, path in kinds.items()) if kinds else ""
        raise errors.UnknownFieldError(f"no entry {key!r} here", path=where,
                                       suggestion=f"valid keys: {existing}{creatable}")
    module_name, name = kinds[key].rsplit(".", 1)
    component = getattr(importlib.import_module(module_name), name)
    entries = dict(getattr(owner, field))
    entries[key] = component.default_config()
    setattr(owner, field, entries)


def _default_config_for(annotation: Any) -> Any:
    """X's default config for an ``Optional[X.Config]`` annotation (one config member only)."""
    members = [m for m in typecheck.union_members(typecheck.strip_annotated(annotation))
               if m is not type(None)]
    configs = [m for m in members if isinstance(m, type) and issubclass(m, ConfigBase)]
    if len(configs) != 1 or len(members) != 1:
        return None
    component = _component_of(configs[0])
    if component is not None and hasattr(component, "default_config"):
        return component.default_config()
    return None


def _component_of(config_class: type) -> Any:
    """The Configurable whose nested ``Config`` is ``config_class`` (None if there is none)."""
    module = sys.modules.get(config_class.__module__)
    qualname = config_class.__qualname__
    if module is None or not qualname.endswith(".Config"):
        return None
    owner: Any = module
    for part in qualname[:-len(".Config")].split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner if getattr(owner, "Config", None) is config_class else None


def _annotation_at(cfg: ConfigBase, tokens: List[paths.PathToken]) -> Any:
    """The annotation that governs the value at ``tokens`` (element type for containers)."""
    parent = cfg.get_recursively(tokens[:-1]) if len(tokens) > 1 else cfg
    last = tokens[-1]
    if isinstance(last, str):
        if not isinstance(parent, ConfigBase):
            cfg.get_recursively(tokens)  # Raises the right error.
        if last not in type(parent).__fields__:
            cfg.get_recursively(tokens)
        return type(parent).field_annotation(last)
    # An element of a container: find the field that holds the container, take its element type.
    field_index = max(i for i, t in enumerate(tokens) if isinstance(t, str))
    owner = cfg.get_recursively(tokens[:field_index]) if field_index else cfg
    annotation = type(owner).field_annotation(tokens[field_index])
    for token in tokens[field_index + 1:]:
        annotation = _element_annotation(annotation, token)
    return annotation


def _element_annotation(annotation: Any, token: paths.PathToken) -> Any:
    annotation = typecheck.strip_annotated(annotation)
    members = [m for m in typecheck.union_members(annotation) if m is not type(None)]
    for member in members:
        args = typing.get_args(member)
        origin = typing.get_origin(member)
        if origin in (dict, typing.get_origin(typing.Mapping[str, int])) and len(args) == 2:
            return args[1]
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            return args[token] if isinstance(token, int) and token < len(args) else Any
        if args:
            return args[0]
    return Any


def parse_value(text: str, annotation: Any, *, path: str) -> Any:
    """Parses command-line ``text`` into a value of type ``annotation``."""
    value, problem = _parse(text, typecheck.strip_annotated(annotation))
    if problem is not None:
        raise errors.ConfigTypeError(
            f"cannot use {text!r}: {problem}", path=path,
            suggestion=f"give a value of type {typecheck.describe_type(annotation)}")
    return value


_TRUE = {"true", "t", "yes", "y", "1", "on"}
_FALSE = {"false", "f", "no", "n", "0", "off"}
_NONE = {"none", "null"}


def _parse(text: str, annotation: Any) -> Tuple[Any, Any]:
    """``(value, None)``, or ``(text, what was expected)``: ``text`` parsed for ``annotation``
    (scalars here, containers and literals by ``_parse_literal``)."""
    stripped = text.strip()
    if typecheck.is_union(annotation):
        return _parse_union(text, annotation)
    if annotation is type(None):
        return (None, None) if stripped.lower() in _NONE else (text, "expected None")
    if annotation is bool:
        if stripped.lower() in _TRUE:
            return True, None
        if stripped.lower() in _FALSE:
            return False, None
        return text, "expected a bool (true/false)"
    if annotation is int:
        try:
            return int(stripped.replace("_", ""), 0), None
        except ValueError:
            try:
                as_float = float(stripped)
            except ValueError:
                return text, "expected an int"
            if as_float.is_integer() and abs(as_float) < 2 ** 53:
                return int(as_float), None  # 1e6 on a command line means 1000000.
            return text, "expected an int"
    if annotation is float:
        try:
            return float(stripped), None
        except ValueError:
            return text, "expected a float"
    if annotation is str:
        return _unquote(text), None
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        name = stripped.split(".")[-1]
        if name in annotation.__members__:
            return annotation[name], None
        return text, f"expected one of {', '.join(annotation.__members__)}"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        for choice in typing.get_args(annotation):
            if str(choice) == _unquote(stripped) or repr(choice) == stripped:
                return choice, None
        close = difflib.get_close_matches(_unquote(stripped),
                                          [str(c) for c in typing.get_args(annotation)], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return text, f"expected {typecheck.describe_type(annotation)}{hint}"
    if _is_config_type(annotation) or origin is type or annotation is type:
        return text, "this field holds a config or a class and cannot be set from text"
    if annotation is typing.Callable or origin is typing.get_origin(typing.Callable):
        return text, "this field holds a function and cannot be set from text"
    return _parse_literal(text, annotation)


def _parse_union(text: str, annotation: Any) -> Tuple[Any, Any]:
    members = typing.get_args(annotation)
    if text.strip().lower() in _NONE and type(None) in members:
        return None, None
    # Literal text parses best against the most specific member first.
    for member in sorted(members, key=_parse_priority):
        if member is type(None) or _is_config_type(member):
            continue
        value, problem = _parse(text, member)
        if problem is None:
            return value, None
    return text, f"expected {typecheck.describe_type(annotation)}"


def _parse_literal(text: str, annotation: Any) -> Tuple[Any, Any]:
    """Containers and Any: Python literal syntax, e.g. (4, 2) or {'a': 1}; `4,2` also works."""
    stripped, origin = text.strip(), typing.get_origin(annotation)
    try:
        literal = ast.literal_eval(stripped)
    except (ValueError, SyntaxError):
        if origin in (list, tuple) or annotation in (list, tuple) or \
                origin is typing.get_origin(typing.Sequence[int]):
            literal = [_literal_or_text(part) for part in stripped.split(",") if part.strip()]
        elif annotation is typecheck.UNCHECKED or annotation is typing.Any:
            return _unquote(text), None
        else:
            return text, "expected a Python literal"
    value, problem = typecheck.coerce(literal, annotation)
    return (value, None) if problem is None else (text, problem)


def _parse_priority(annotation: Any) -> int:
    order = {type(None): 0, bool: 1, int: 2, float: 3}
    if annotation in order:
        return order[annotation]
    if annotation is str:
        return 9  # Anything parses as a string: try it last.
    return 5


def _is_config_type(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, ConfigBase) \
        or annotation is InstantiableConfig


def _unquote(text: str) -> str:
    stripped = text.strip()
    if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
        return stripped[1:-1]
    return text


def _literal_or_text(part: str) -> Any:
    try:
        return ast.literal_eval(part.strip())
    except (ValueError, SyntaxError):
        return part.strip()


def config_diff(before: ConfigBase, after: ConfigBase) -> List[str]:
    """``path: old -> new`` lines for every leaf that differs (added or removed leaves too)."""
    old: Dict[str, Any] = before.to_flat_dict()
    new: Dict[str, Any] = after.to_flat_dict()
    lines = []
    for path in list(new) + [p for p in old if p not in new]:
        old_text = formatting.format_value(old[path]) if path in old else "<absent>"
        new_text = formatting.format_value(new[path]) if path in new else "<absent>"
        # An optional part switched on (None -> its fields) or off shows as its fields only.
        if path not in new and any(p.startswith(path + ".") for p in new) or \
                path not in old and any(p.startswith(path + ".") for p in old):
            continue
        if old_text != new_text:
            lines.append(f"{path}: {old_text} -> {new_text}")
    return lines


def diff_debug_strings(before: str, after: str) -> List[str]:
    """``path: old -> new`` lines between two ``debug_string()`` dumps (e.g. a checkpoint's
    saved config and this run's)."""
    old, new = _parse_debug_string(before), _parse_debug_string(after)
    lines = []
    for path in list(new) + [p for p in old if p not in new]:
        old_text, new_text = old.get(path, "<absent>"), new.get(path, "<absent>")
        if old_text != new_text and not _same_items(old_text, new_text):
            lines.append(f"{path}: {old_text} -> {new_text}")
    return lines


def _same_items(a: str, b: str) -> bool:
    """Whether two dumped values are the same items, one a list and the other a tuple (a
    sequence field set from the command line holds a list, its default a tuple)."""
    try:
        x, y = ast.literal_eval(a), ast.literal_eval(b)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return False
    return isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and list(x) == list(y)


def _parse_debug_string(text: str) -> Dict[str, str]:
    entries: Dict[str, str] = {}
    for line in text.splitlines():
        path, sep, value = line.partition(": ")
        if sep:
            entries[path] = value
    return entries
