"""The files a command reads and the directories it writes, checked before any work is done.

``read_json_object``: a JSON file that must hold an object (a model's config.json, a run record,
a tokenizer_config.json); an unreadable or malformed one is the caller's error kind, naming the
file. ``new_directory``: a directory to write into that must be new or empty and creatable --
nothing a user saved is overwritten or mixed with another output.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Type

from titanax import errors


def read_json_object(path: str, *, error: Type[errors.TitanaxError],
                     suggestion: str = "fix or replace the file") -> Dict[str, Any]:
    """The JSON object in ``path``; unreadable, malformed or not an object: ``error``."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise error(f"cannot read it: {e}", path=path, suggestion=suggestion) from e
    if not isinstance(value, dict):
        raise error("it is not a JSON object", path=path, suggestion=suggestion)
    return value


def new_directory(path: str, *, where: str, error: Type[errors.TitanaxError]) -> str:
    """``path`` made absolute, refused (``error`` naming ``where``) when it exists and is not
    an empty directory, or cannot be created under its nearest existing ancestor."""
    path = os.path.abspath(path)
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise error("exists and is not an empty directory", path=f"{where}: {path}",
                    suggestion="give a new directory (nothing is overwritten or mixed into "
                               "another)")
    ancestor = path
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor) or not os.access(ancestor, os.W_OK | os.X_OK):
        raise error(f"cannot create it: {ancestor} is "
                    + ("not a directory" if not os.path.isdir(ancestor) else "not writable"),
                    path=f"{where}: {path}",
                    suggestion="give a directory under one you can write to")
    return path
