"""``REQUIRED``: the value of a config field that must be set before the config is used (its own
file: the config tree, its formatting and its type checks all read it)."""

from __future__ import annotations

from typing import Optional


class RequiredFieldValue:
    """The type of ``REQUIRED``: a field that must be set before the config is used."""

    _instance: Optional["RequiredFieldValue"] = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "REQUIRED"

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def __reduce__(self):
        return (RequiredFieldValue, ())

    def __bool__(self) -> bool:
        return False


REQUIRED = RequiredFieldValue()
