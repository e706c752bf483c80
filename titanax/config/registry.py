"""Named experiments: ``python -m titanax.launch --config=gpt_tiny_dp_tp``.

An experiment is a function that returns a fresh config tree. Modules register experiments either
with the ``@register_experiment`` decorator or by defining ``named_configs()`` returning
``{name: factory}``. The launcher loads the project's ``experiments`` package plus any module given
with ``--config_module=my_pkg.my_exps``; a package is loaded with all its submodules.

Factories are called on every lookup, so each caller gets its own tree to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import pkgutil
import sys
from typing import Callable, Dict, Iterable, List, Optional

from titanax import errors
from titanax.config.base import ConfigBase

ConfigFactory = Callable[[], ConfigBase]

# The built-in experiments: the top-level folder experiments/, installed under this name (setup.py)
# so that a user's own `experiments` package cannot hide them.
DEFAULT_CONFIG_MODULES = ("titanax_experiments",)


@dataclasses.dataclass(frozen=True)
class Experiment:
    """A registered experiment."""

    name: str
    factory: ConfigFactory
    # The module that registered it (shown by --list, and in duplicate-name errors).
    module: str
    # First line of the factory's docstring.
    summary: str


_EXPERIMENTS: Dict[str, Experiment] = {}


def register_experiment(name_or_factory=None, *, name: Optional[str] = None):
    """Registers a config factory under ``name`` (default: the function's name).

    Use as ``@register_experiment`` or ``@register_experiment("other_name")``.
    """
    if callable(name_or_factory):
        _register(name or name_or_factory.__name__, name_or_factory)
        return name_or_factory
    explicit = name_or_factory or name

    def decorator(factory: ConfigFactory) -> ConfigFactory:
        _register(explicit or factory.__name__, factory)
        return factory

    return decorator


def _register(name: str, factory: ConfigFactory, module: Optional[str] = None) -> None:
    module = module or getattr(factory, "__module__", "<unknown>")
    existing = _EXPERIMENTS.get(name)
    if existing is not None and (existing.module != module
                                 or existing.factory.__qualname__ != factory.__qualname__):
        raise errors.ConfigError(
            f"experiment {name!r} is registered twice: by {existing.module} and by {module}",
            path=name, suggestion="rename one of them")
    doc = (factory.__doc__ or "").strip().splitlines()
    _EXPERIMENTS[name] = Experiment(name=name, factory=factory, module=module,
                                    summary=doc[0] if doc else "")


def load_config_modules(module_names: Iterable[str]) -> None:
    """Imports each module (and, for packages, every submodule) so its experiments register.

    The current folder is searched too (``python -m`` adds it to ``sys.path``, an installed
    console script such as ``titanax-launch`` does not), so ``--config_module=my_exps`` finds
    ``./my_exps.py`` either way.
    """
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    for module_name in module_names:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            if e.name and module_name.startswith(e.name) or e.name == module_name:
                raise errors.ConfigError(
                    f"cannot import config module {module_name!r}: {e}", path="--config_module",
                    suggestion="give an importable module path, e.g. my_pkg.my_experiments") from e
            raise
        _register_named_configs(module)
        if hasattr(module, "__path__"):
            for info in pkgutil.iter_modules(module.__path__, prefix=module.__name__ + "."):
                _register_named_configs(importlib.import_module(info.name))


def _register_named_configs(module) -> None:
    named = getattr(module, "named_configs", None)
    if callable(named):
        for name, factory in named().items():
            _register(name, factory, module=module.__name__)


def experiment_names() -> List[str]:
    return sorted(_EXPERIMENTS)


def experiments() -> List[Experiment]:
    return [_EXPERIMENTS[name] for name in experiment_names()]


def get_experiment(name: str) -> Experiment:
    if name not in _EXPERIMENTS:
        close = difflib.get_close_matches(name, list(_EXPERIMENTS), n=3, cutoff=0.5)
        suggestion = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        suggestion += "run `python -m titanax.launch --list` to see all registered experiments"
        raise errors.UnknownExperimentError(f"no experiment named {name!r} is registered",
                                            path="--config", suggestion=suggestion)
    return _EXPERIMENTS[name]


def get_config(name: str) -> ConfigBase:
    """A fresh config tree of the named experiment."""
    experiment = get_experiment(name)
    cfg = experiment.factory()
    if not isinstance(cfg, ConfigBase):
        raise errors.ConfigError(
            f"the factory of experiment {name!r} returned a {type(cfg).__qualname__}, not a config",
            path=f"{experiment.module}.{experiment.factory.__name__}",
            suggestion="return a config, e.g. SomeComponent.default_config().set(...)")
    return cfg
