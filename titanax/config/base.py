"""ConfigBase: typed, copy-on-assign, validate-before-build configuration trees.

Every Titanax component (mesh, plan, layer, learner, checkpointer, engine) is built from a tree of
these. The design follows AXLearn's ``config.py`` (itself Lingvo's ``Params``) and fixes what its
users trip over:

* Fields are declared with type annotations on a class; a subclass of a component declares
  ``class Config(Parent.Config)`` and adds fields. No decorator is needed (``config_class`` exists
  for readers used to AXLearn, and is a no-op check).
* Assignment is checked against the annotation and fails on the spot, naming the field.
* Values are *copied* on assignment, so ``a.child = b; b.x = 1`` does not change ``a``. Shared
  mutable sub-configs are the classic source of "why did my change leak into the teacher model".
* ``validate()`` walks the whole tree before anything is instantiated and reports *every* problem
  at once, each with its full path (``model.decoder.num_heads: REQUIRED field not set``).
* ``debug_string()`` is a stable ``path: value`` dump, used for golden files and saved next to each
  run's checkpoints.

This package imports nothing from jax: a config can be built, printed and validated on a laptop.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import sys
import typing
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from titanax import errors
from titanax.config import formatting, paths, typecheck
from titanax.config.required import REQUIRED, RequiredFieldValue




class Required:
    """``Required[int]`` annotates a field that has no sensible default and must be set.

    It means ``Union[int, RequiredFieldValue]``: the field may hold ``REQUIRED`` until
    ``validate()`` runs, which reports it if it is still unset.
    """

    def __class_getitem__(cls, item):
        return Union[item, RequiredFieldValue]


@dataclasses.dataclass
class FieldSpec:
    """One declared config field."""

    name: str
    # The annotation as written (possibly a string under `from __future__ import annotations`).
    raw_annotation: Any
    # The default value; REQUIRED when the declaration has none.
    default: Any
    # The class whose body declared the field (used to resolve string annotations).
    owner: type


# Method and attribute names of configs that fields may not shadow.
_RESERVED_NAMES = frozenset({
    "set", "clone", "instantiate", "validate", "visit", "keys", "items", "to_dict", "to_flat_dict",
    "to_json", "debug_string", "freeze", "is_frozen", "get_recursively", "set_recursively",
    "field_annotation", "fields",
})


class ConfigBase:
    """A tree of typed fields. Subclass and annotate fields to declare a config."""

    # name -> FieldSpec, in declaration order (parents first). Filled by __init_subclass__.
    __fields__: Dict[str, FieldSpec] = {}
    # name -> resolved annotation, filled lazily (string annotations may refer to later classes).
    __resolved__: Optional[Dict[str, Any]] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _collect_fields(cls)

    def __init__(self, **values: Any):
        object.__setattr__(self, "_frozen", False)
        annotations = type(self)._resolved_annotations()
        for name, spec in type(self).__fields__.items():
            default = _copy_value(spec.default)
            if not isinstance(default, RequiredFieldValue):
                default, problem = typecheck.coerce(default, annotations[name])
                if problem is not None:
                    raise errors.ConfigTypeError(
                        f"the declared default does not match the annotation: {problem}",
                        path=f"{spec.owner.__qualname__}.{name}",
                        suggestion="fix the default or the annotation in the class body")
            object.__setattr__(self, name, default)
        for name, value in values.items():
            setattr(self, name, value)

    # --- Fields ----------------------------------------------------------------------------------

    @classmethod
    def fields(cls) -> Tuple[str, ...]:
        """Names of the declared fields, in declaration order."""
        return tuple(cls.__fields__)

    @classmethod
    def field_annotation(cls, name: str) -> Any:
        """The resolved annotation of field ``name``."""
        return cls._resolved_annotations()[name]

    @classmethod
    def _resolved_annotations(cls) -> Dict[str, Any]:
        if cls.__dict__.get("__resolved__") is None:
            cls.__resolved__ = _resolve_annotations(cls)
        return cls.__resolved__

    def keys(self) -> List[str]:
        return list(type(self).__fields__)

    def items(self) -> List[Tuple[str, Any]]:
        return [(name, getattr(self, name)) for name in type(self).__fields__]

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        if self.is_frozen:
            raise errors.FrozenConfigError(
                f"cannot set field {name!r} of a frozen {type(self).__qualname__}", path=name,
                suggestion="call .clone() to get a mutable copy")
        if name not in type(self).__fields__:
            raise unknown_field_error(self, name, path=name)
        object.__setattr__(self, name, self._checked_value(name, value))

    def _checked_value(self, name: str, value: Any) -> Any:
        """The value to store in field ``name``: type-checked, normalised and copied."""
        if isinstance(value, RequiredFieldValue):
            return value
        coerced, problem = typecheck.coerce(value, type(self).field_annotation(name))
        if problem is not None:
            raise errors.ConfigTypeError(
                f"{problem} (field of {type(self).__qualname__})", path=name,
                suggestion=f"assign a value of type "
                           f"{typecheck.describe_type(type(self).field_annotation(name))}")
        return _copy_value(coerced)

    def set(self, **values: Any) -> "ConfigBase":
        """Sets several fields and returns ``self``, so calls chain: ``cfg.set(a=1).set(b=2)``."""
        for name, value in values.items():
            setattr(self, name, value)
        return self

    def clone(self, **values: Any) -> "ConfigBase":
        """A deep, unfrozen copy with ``values`` applied."""
        duplicate = copy.deepcopy(self)
        _set_frozen(duplicate, False)
        return duplicate.set(**values)

    # --- Freezing --------------------------------------------------------------------------------

    def freeze(self) -> "ConfigBase":
        """Makes this config and every config below it read-only; returns ``self``."""
        _set_frozen(self, True)
        return self

    @property
    def is_frozen(self) -> bool:
        return self.__dict__.get("_frozen", False)

    # --- Paths -----------------------------------------------------------------------------------

    def get_recursively(self, path: Union[str, Sequence[paths.PathToken]]) -> Any:
        """The value at ``path`` (``"a.b[0].c"`` or ``["a", "b", 0, "c"]``)."""
        tokens = paths.parse_path(path)
        value: Any = self
        for depth, token in enumerate(tokens):
            value = _step(value, token, tokens[:depth])
        return value

    def set_recursively(self, path: Union[str, Sequence[paths.PathToken]], value: Any) -> None:
        """Sets the value at ``path``; the change is type-checked by the config that owns it.

        Elements of lists, tuples and dicts are set by rebuilding the container and assigning it to
        its field, so the owning config checks the new container as a whole.
        """
        tokens = paths.parse_path(path)
        _set_at(self, tokens, value, [])

    # --- Walking and dumping -----------------------------------------------------------------------

    def walk(self, prefix: str = "") -> Iterator[Tuple[str, Any]]:
        """Yields ``(path, value)`` for every leaf, depth first, in field order.

        Nested configs are entered; so are dicts, and lists/tuples holding configs or dicts. Every
        other value (including a tuple of ints) is one leaf.
        """
        for name in type(self).__fields__:
            yield from _walk_value(paths.join_path(prefix, name), getattr(self, name))

    def visit(self, visit_fn: Callable[[str, Any], None], *,
              enter_fn: Optional[Callable[[str, "ConfigBase"], bool]] = None,
              prefix: str = "") -> None:
        """Calls ``visit_fn(path, value)`` on every leaf.

        ``enter_fn(path, config)``, if given, is called on each nested config first; when it returns
        False the config is passed to ``visit_fn`` as a leaf instead of being entered.
        """
        for name in type(self).__fields__:
            _visit_value(paths.join_path(prefix, name), getattr(self, name), visit_fn, enter_fn)

    def to_flat_dict(self) -> Dict[str, Any]:
        """``{path: leaf value}`` over the whole tree."""
        return dict(self.walk())

    def to_dict(self) -> Dict[str, Any]:
        """A nested dict of plain values; nested configs become dicts."""
        return {name: _to_plain(getattr(self, name), json=False) for name in type(self).__fields__}

    def to_json(self) -> Dict[str, Any]:
        """Like ``to_dict`` but JSON-serialisable: functions and classes become import paths."""
        return {name: _to_plain(getattr(self, name), json=True) for name in type(self).__fields__}

    def debug_string(self) -> str:
        """One ``path: value`` line per leaf; unset fields print as ``REQUIRED``."""
        return "".join(f"{path}: {formatting.format_value(value)}\n" for path, value in self.walk())

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={formatting.format_value(value)}"
                          if not isinstance(value, ConfigBase) else f"{name}={value!r}"
                          for name, value in self.items())
        return f"{type(self).__qualname__}({inner})"

    def __eq__(self, other: Any) -> bool:
        if type(self) is not type(other):
            return NotImplemented
        return all(_values_equal(getattr(self, n), getattr(other, n)) for n in type(self).__fields__)

    __hash__ = None  # Mutable.

    # --- Validation ------------------------------------------------------------------------------

    def validate(self, *, prefix: str = "") -> "ConfigBase":
        """Checks the whole tree; raises one ConfigValidationError listing every problem.

        Reports fields still ``REQUIRED``, values whose type no longer matches (a list mutated in
        place after assignment, say) and what each config's ``_validate_values`` hook finds.
        Returns ``self`` so it chains.
        """
        problems = list(self._collect_problems(prefix))
        if problems:
            raise errors.ConfigValidationError(problems)
        return self

    def _collect_problems(self, prefix: str) -> Iterator[errors.TitanaxError]:
        cls = type(self)
        for name in cls.__fields__:
            path = paths.join_path(prefix, name)
            value = getattr(self, name)
            if isinstance(value, RequiredFieldValue):
                yield errors.RequiredFieldError(
                    "REQUIRED field not set", path=path,
                    suggestion="set it to a value of type "
                               f"{typecheck.describe_type(cls.field_annotation(name))}")
                continue
            _, problem = typecheck.coerce(value, cls.field_annotation(name))
            if problem is not None:
                yield errors.ConfigTypeError(problem, path=path)
            yield from _problems_below(path, value)
        for field_name, message in self._validate_values():
            yield errors.ConfigError(message, path=paths.join_path(prefix, field_name)
                                     if field_name else (prefix or type(self).__qualname__))

    def _validate_values(self) -> Iterable[Tuple[str, str]]:
        """Hook for checks across fields. Yields ``(field_name or "", message)`` per problem."""
        return ()


def unknown_field_error(config: ConfigBase, name: str, *, path: str) -> errors.UnknownFieldError:
    """An UnknownFieldError for ``name`` with did-you-mean suggestions and the valid fields."""
    valid = list(type(config).__fields__)
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.6)
    suggestion = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    suggestion += f"valid fields of {type(config).__qualname__}: {', '.join(valid) or '(none)'}"
    return errors.UnknownFieldError(
        f"{type(config).__qualname__} has no field {name!r}", path=path, suggestion=suggestion)


# --- Field collection ----------------------------------------------------------------------------

def _collect_fields(cls: type) -> None:
    fields: Dict[str, FieldSpec] = {}
    for base in reversed(cls.__mro__[1:]):
        fields.update(base.__dict__.get("__fields__", {}))
    fields = {name: dataclasses.replace(spec) for name, spec in fields.items()}
    own_annotations = cls.__dict__.get("__annotations__", {})
    for name, annotation in own_annotations.items():
        if name.startswith("_") or _is_classvar(annotation):
            continue
        if name in _RESERVED_NAMES:
            raise errors.ConfigError(f"field name {name!r} shadows a config method",
                                     path=f"{cls.__qualname__}.{name}",
                                     suggestion="rename the field")
        default = cls.__dict__.get(name, REQUIRED)
        fields[name] = FieldSpec(name=name, raw_annotation=annotation, default=default, owner=cls)
    # A subclass may change an inherited default without re-annotating: `dim = 64`.
    for name in list(fields):
        if name not in own_annotations and name in cls.__dict__:
            attribute = cls.__dict__[name]
            if isinstance(attribute, (property, classmethod, staticmethod)) or callable(attribute) \
                    and getattr(attribute, "__qualname__", "").startswith(cls.__qualname__ + "."):
                raise errors.ConfigError(f"{name!r} is a field of a parent config; it cannot also "
                                         "be a method", path=f"{cls.__qualname__}.{name}",
                                         suggestion="rename the method")
            fields[name].default = attribute
    for name in fields:
        if name in cls.__dict__:
            delattr(cls, name)  # Values live on instances; the class keeps only FieldSpecs.
    cls.__fields__ = fields
    cls.__resolved__ = None


def _is_classvar(annotation: Any) -> bool:
    if isinstance(annotation, str):
        return annotation.startswith(("ClassVar", "typing.ClassVar"))
    return annotation is typing.ClassVar or typing.get_origin(annotation) is typing.ClassVar


def _resolve_annotations(cls: type) -> Dict[str, Any]:
    resolved = {}
    for name, spec in cls.__fields__.items():
        annotation = spec.raw_annotation
        if isinstance(annotation, str):
            module = sys.modules.get(spec.owner.__module__)
            namespace = dict(vars(module)) if module else {}
            namespace.update({"Required": Required, "REQUIRED": REQUIRED})
            try:
                annotation = eval(annotation, namespace)  # pylint: disable=eval-used
            except Exception:  # pylint: disable=broad-except
                annotation = typecheck.UNCHECKED
        resolved[name] = annotation
    return resolved


# --- Helpers over values -------------------------------------------------------------------------

def _copy_value(value: Any) -> Any:
    try:
        return copy.deepcopy(value)
    except Exception:  # pylint: disable=broad-except
        return value  # Devices, locks and other objects that refuse to be copied are shared.


def _set_frozen(value: Any, frozen: bool) -> None:
    if isinstance(value, ConfigBase):
        object.__setattr__(value, "_frozen", frozen)
        for _, child in value.items():
            _set_frozen(child, frozen)
    elif isinstance(value, (list, tuple)):
        for child in value:
            _set_frozen(child, frozen)
    elif isinstance(value, dict):
        for child in value.values():
            _set_frozen(child, frozen)


def _is_expandable(value: Any) -> bool:
    if isinstance(value, dict):
        return bool(value)
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, (ConfigBase, dict)) for v in value)
    return False


def _walk_value(path: str, value: Any) -> Iterator[Tuple[str, Any]]:
    if isinstance(value, ConfigBase):
        yield from value.walk(path)
    elif _is_expandable(value):
        entries = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in entries:
            token = paths.Key(key) if isinstance(value, dict) else key
            yield from _walk_value(paths.join_path(path, token), child)
    else:
        yield path, value


def _visit_value(path, value, visit_fn, enter_fn) -> None:
    if isinstance(value, ConfigBase):
        if enter_fn is None or enter_fn(path, value):
            value.visit(visit_fn, enter_fn=enter_fn, prefix=path)
        else:
            visit_fn(path, value)
    elif _is_expandable(value):
        entries = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in entries:
            token = paths.Key(key) if isinstance(value, dict) else key
            _visit_value(paths.join_path(path, token), child, visit_fn, enter_fn)
    else:
        visit_fn(path, value)


def _to_plain(value: Any, *, json: bool) -> Any:
    if isinstance(value, ConfigBase):
        return value.to_json() if json else value.to_dict()
    if isinstance(value, dict):
        return {(str(k) if json else k): _to_plain(v, json=json) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_to_plain(v, json=json) for v in value]
        return items if json or isinstance(value, list) else tuple(items)
    return formatting.json_value(value) if json else copy.copy(value)


def _values_equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # pylint: disable=broad-except  (arrays compare elementwise)
        return a is b


def _problems_below(path: str, value: Any) -> Iterator[errors.TitanaxError]:
    """Problems of configs nested in ``value`` (directly or inside containers)."""
    if isinstance(value, ConfigBase):
        yield from value._collect_problems(path)  # pylint: disable=protected-access
    elif isinstance(value, dict):
        for key, child in value.items():
            yield from _problems_below(paths.join_path(path, paths.Key(key)), child)
    elif isinstance(value, (list, tuple)):
        for index, child in enumerate(value):
            yield from _problems_below(paths.join_path(path, index), child)


def _step(value: Any, token: paths.PathToken, walked: List[paths.PathToken]) -> Any:
    where = paths.format_path(walked + [token])
    if isinstance(token, str):
        if isinstance(value, dict):
            parent = paths.format_path(walked)
            keys = ", ".join(repr(k) for k in value) or "(none)"
            raise errors.UnknownFieldError(
                f"{parent} is a dict: its entries are indexed with [key], not .{token}",
                path=where, suggestion=f"write {parent}[{token!r}] (keys: {keys})")
        if not isinstance(value, ConfigBase):
            raise errors.UnknownFieldError(
                f"cannot read field {token!r} of a {type(value).__qualname__} (not a config)",
                path=where, suggestion=f"{paths.format_path(walked) or 'the root'} is a leaf value")
        if token not in type(value).__fields__:
            raise unknown_field_error(value, token, path=where)
        return getattr(value, token)
    key = token.value if isinstance(token, paths.Key) else token
    try:
        return value[key]
    except (KeyError, IndexError, TypeError) as e:
        hint = (f"valid keys: {', '.join(repr(k) for k in value)}" if isinstance(value, dict)
                else f"length is {len(value)}" if isinstance(value, (list, tuple))
                else f"the value is a {type(value).__qualname__}")
        raise errors.UnknownFieldError(f"no entry {key!r} here", path=where,
                                       suggestion=hint) from e


def _set_at(node: Any, tokens: List[paths.PathToken], value: Any,
            walked: List[paths.PathToken]) -> Any:
    """Returns ``node`` with the value at ``tokens`` replaced (configs are changed in place)."""
    token, rest = tokens[0], tokens[1:]
    where = paths.format_path(walked + [token])
    child_value = value if not rest else _set_at(_step(node, token, walked), rest, value,
                                                 walked + [token])
    if isinstance(token, str):
        try:
            setattr(node, token, child_value)
        except errors.ConfigError as e:
            raise type(e)(e.message, path=where, suggestion=e.suggestion) from None
        return node
    if isinstance(node, ConfigBase):
        raise errors.UnknownFieldError("configs are indexed by field name, not by subscript",
                                       path=where)
    key = token.value if isinstance(token, paths.Key) else token
    if isinstance(node, dict):
        updated = dict(node)
        updated[key] = child_value
        return updated
    updated_list = list(node)
    updated_list[key] = child_value
    return type(node)(updated_list) if isinstance(node, tuple) else updated_list


class InstantiableConfig(ConfigBase):
    """A config that can build the object it describes."""

    def instantiate(self, **extra: Any) -> Any:
        """Validates the tree, then builds the object; ``extra`` goes to the constructor."""
        raise NotImplementedError(f"{type(self).__qualname__} does not define instantiate()")


def config_class(cls: type) -> type:
    """Marks a config class, AXLearn style. Fields are collected automatically; this only checks."""
    if not (isinstance(cls, type) and issubclass(cls, ConfigBase)):
        raise errors.ConfigError(f"{cls!r} must subclass ConfigBase to be a config class",
                                 path=getattr(cls, "__qualname__", repr(cls)))
    return cls
