"""Objects built from configs: ``Configurable``, and configs of plain functions and classes.

``Configurable`` is the base of every Titanax component. Its nested ``Config`` carries the class to
build (``klass``), so a config tree alone says what will be constructed; ``instantiate()`` validates
the whole subtree first, so a missing field deep in a model fails before any device work starts.

``config_for_function(optax.adamw)`` and ``config_for_class(SomeClass)`` turn a signature into a
config, which lets third-party factories sit in the tree and be overridden from the command line
like any other field (``--config.learner.optimizer.learning_rate=1e-3``).
"""

from __future__ import annotations

import inspect
import typing
from typing import Any, Callable, Dict, Optional, Type, TypeVar, Union

from titanax import errors
from titanax.config.base import REQUIRED, InstantiableConfig, RequiredFieldValue

T = TypeVar("T")


class ConfigOr:
    """``ConfigOr[T]`` annotates a field holding either a ``T`` or a config that builds one.

    Read it with ``maybe_instantiate(value)``.
    """

    def __class_getitem__(cls, item):
        return Union[item, InstantiableConfig]


def maybe_instantiate(value: Any) -> Any:
    """``value.instantiate()`` when ``value`` is an instantiable config, else ``value`` itself."""
    if isinstance(value, InstantiableConfig):
        return value.instantiate()
    return value


class Configurable:
    """Base class of everything Titanax builds from a config.

    Subclasses declare ``class Config(Parent.Config)`` with their fields, and are built with
    ``SomeClass.default_config().set(...).instantiate()``. The instance keeps a frozen copy of its
    config in ``self.config``.
    """

    class Config(InstantiableConfig):
        """Base config of Configurables."""

        # The class this config builds. Set by default_config(); rarely set by hand.
        klass: type = REQUIRED

        def instantiate(self, **extra: Any) -> Any:
            completed = self.completed()
            completed.validate()
            return self.klass(completed, **extra)

        def completed(self) -> "Configurable.Config":
            """This config with what it leaves to be derived filled in, before it is validated
            (an Engine's model vocabulary from its train input); itself by default."""
            return self

    @classmethod
    def default_config(cls) -> "Configurable.Config":
        """A fresh config with every field at its default and ``klass`` set to ``cls``."""
        cfg = cls.Config()
        cfg.klass = cls
        return cfg

    def __init__(self, cfg: Optional["Configurable.Config"] = None, **fields: Any):
        """Builds from ``cfg``, or from keyword field values: ``MeshSpec(axes=("data",))``.

        Keyword values may be components themselves (``Plan(data_parallel=DP(axis="data"))``):
        their configs are used.
        """
        if cfg is None:
            cfg = type(self).default_config().set(
                **{name: _as_config(value) for name, value in fields.items()}
            ).completed().validate()
        elif fields:
            raise errors.ConfigError(
                f"{type(self).__qualname__} got both a config and field values "
                f"({', '.join(fields)})", path=type(self).__qualname__,
                suggestion="set the fields on the config, or pass field values alone")
        if not isinstance(cfg, type(self).Config):
            raise errors.ConfigError(
                f"{type(self).__qualname__} needs a {type(self).Config.__qualname__}, got a "
                f"{type(cfg).__qualname__}", path=type(self).__qualname__,
                suggestion=f"build it with {type(self).__qualname__}.default_config()")
        self._config = cfg.clone().freeze()

    @property
    def config(self) -> "Configurable.Config":
        """The (frozen) config this object was built from."""
        return self._config


def _as_config(value: Any) -> Any:
    """Components given as keyword values stand for their configs (also inside lists)."""
    if isinstance(value, Configurable):
        return value.config.clone()
    if isinstance(value, (list, tuple)) and any(isinstance(v, Configurable) for v in value):
        return type(value)(_as_config(v) for v in value)
    return value


class FunctionConfigBase(InstantiableConfig):
    """Config of a function call: one field per parameter, plus ``fn``.

    ``instantiate(**extra)`` calls ``fn(**fields, **extra)``. Field values that are themselves
    instantiable configs are instantiated first (a schedule config inside an optimizer config).
    """

    __target__: Callable = None  # Set on the generated subclass.

    def _validate_values(self):
        """The target's own argument checks (``checked_by``), on the values as configured."""
        check = getattr(self.fn, ARGUMENT_CHECKS, None)
        if check is not None:
            yield from check(**{name: value for name, value in self.items() if name != "fn"})

    def instantiate(self, **extra: Any) -> Any:
        self.validate()
        kwargs = {name: maybe_instantiate(value) for name, value in self.items() if name != "fn"}
        kwargs.update(extra)
        return self.fn(**kwargs)


# The attribute ``checked_by`` sets on a function.
ARGUMENT_CHECKS = "__titanax_argument_checks__"


def checked_by(check: Callable[..., Any]) -> Callable[[Callable], Callable]:
    """Gives a function (or class) argument checks that ``config_for_function`` configs of it run
    in ``validate()``: ``check(**arguments)`` yields ``(argument name, problem)`` for each bad
    one, so the error names the config path (``learner.optimizer.b2: must be in [0, 1)``) before
    anything is built. Arguments may hold configs (a schedule), which the check skips."""
    def attach(fn: Callable) -> Callable:
        setattr(fn, ARGUMENT_CHECKS, check)
        return fn
    return attach


class ClassConfigBase(FunctionConfigBase):
    """Config of a class constructor: one field per ``__init__`` parameter, plus ``fn``."""


_GENERATED: Dict[Any, type] = {}


def config_for_function(fn: Callable[..., T], **values: Any) -> FunctionConfigBase:
    """A config whose fields are the parameters of ``fn`` (defaults kept; none -> REQUIRED).

    Example: ``config_for_function(optax.adamw).set(learning_rate=1e-3).instantiate()``.
    """
    return _generated_config_class(fn, base=FunctionConfigBase)(fn=fn, **values)


def config_for_class(cls: Type[T], **values: Any) -> ClassConfigBase:
    """A config whose fields are the parameters of ``cls.__init__``."""
    if not isinstance(cls, type):
        raise errors.ConfigError(f"config_for_class needs a class, got {cls!r}",
                                 path="config_for_class", suggestion="use config_for_function")
    return _generated_config_class(cls, base=ClassConfigBase)(fn=cls, **values)


def _generated_config_class(target: Callable, *, base: type) -> type:
    key = (target, base)
    if key in _GENERATED:
        return _GENERATED[key]
    signature_of = target.__init__ if isinstance(target, type) else target
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError) as e:
        raise errors.ConfigError(f"cannot read the signature of {target!r}: {e}",
                                 path=getattr(target, "__qualname__", repr(target))) from e
    hints = _type_hints(signature_of)
    annotations: Dict[str, Any] = {"fn": Callable}
    namespace: Dict[str, Any] = {}
    for name, parameter in signature.parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if name == "fn" or name.startswith("_"):
            raise errors.ConfigError(f"cannot make a config for a function with a parameter "
                                     f"named {name!r}", path=f"{target.__qualname__}.{name}",
                                     suggestion="wrap the function in one with other names")
        annotation = hints.get(name, Any)
        # Any field may hold a config that builds its value (instantiated before the call).
        annotations[name] = annotation if annotation is Any else Union[annotation,
                                                                          InstantiableConfig]
        has_default = parameter.default is not inspect.Parameter.empty
        namespace[name] = parameter.default if has_default else REQUIRED
        if has_default and parameter.default is None:
            annotations[name] = Optional[annotations[name]]
    namespace["__annotations__"] = annotations
    namespace["__module__"] = base.__module__
    namespace["__target__"] = target
    name = f"{getattr(target, '__name__', 'function')}_config"
    generated = type(name, (base,), namespace)
    generated.__qualname__ = f"config_for({getattr(target, '__qualname__', name)})"
    _check_defaults(generated)
    _GENERATED[key] = generated
    return generated


def _check_defaults(generated: type) -> None:
    """Relaxes to ``Any`` the annotations that the function's own defaults do not satisfy."""
    from titanax.config import typecheck  # pylint: disable=import-outside-toplevel
    resolved = generated._resolved_annotations()  # pylint: disable=protected-access
    for name, spec in generated.__fields__.items():
        if isinstance(spec.default, RequiredFieldValue):
            continue
        _, problem = typecheck.coerce(spec.default, resolved[name])
        if problem is not None:
            resolved[name] = Any


def _type_hints(fn: Callable) -> Dict[str, Any]:
    try:
        return typing.get_type_hints(fn, include_extras=True)
    except Exception:  # pylint: disable=broad-except
        pass
    hints = {}
    try:
        for name, parameter in inspect.signature(fn).parameters.items():
            if parameter.annotation is not inspect.Parameter.empty and \
                    not isinstance(parameter.annotation, str):
                hints[name] = parameter.annotation
    except (TypeError, ValueError):
        pass
    return hints
