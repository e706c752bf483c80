"""Params' paths as text (``a/b/0/c``): what errors, rules and reports name a param by."""

from __future__ import annotations

from typing import Any, Sequence

import jax


def path_string(key_path: Sequence[Any]) -> str:
    """``a/b/0/c`` from a jax key path (dict keys, attribute names and sequence indices)."""
    parts = []
    for key in key_path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    return "/".join(parts)
