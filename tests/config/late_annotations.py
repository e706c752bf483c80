"""A config module written with postponed (string) annotations, as many user modules are."""

from __future__ import annotations

from typing import Optional

from titanax.config import ConfigBase


class Late(ConfigBase):
    # Refers to a class defined further down the module.
    inner: Optional[Inner] = None
    size: Optional[int] = None


class Inner(ConfigBase):
    width: int = 1
