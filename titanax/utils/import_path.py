"""Objects a user names by import path (a reward function, a tool, an environment class).

Why one place: each such name is a config field, and a wrong one must be refused by that field
before anything runs -- not found as an ``ImportError`` or ``AttributeError`` deep inside a
rollout.
"""

from __future__ import annotations

import importlib
from typing import Any, Type

from titanax import errors


def import_object(path: str, *, where: str, what: str,
                  error: Type[errors.TitanaxError]) -> Any:
    """The object at ``path`` (``package.module.name`` or ``package.module:name``); ``where``:
    the config path naming it, ``what``: what it should be ("function", "class"), ``error``:
    the exception class raised (by name) when it cannot be imported."""
    module_name, _, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module_name or not name:
        raise error(f"{path!r} is no import path", path=where,
                    suggestion=f"write package.module.{what}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise error(f"cannot import {module_name!r} ({e})", path=where,
                    suggestion="make the module importable (PYTHONPATH, or run from its "
                               "directory)") from None
    if not hasattr(module, name):
        defined = ", ".join(n for n in dir(module) if not n.startswith("_"))
        raise error(f"{module_name} has no {what} {name!r}", path=where,
                    suggestion=f"check the name: {module_name} defines {defined[:200]}")
    return getattr(module, name)
