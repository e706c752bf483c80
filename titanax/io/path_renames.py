"""Param paths renamed between versions: a checkpoint written under the old names restores.

A model may declare ``checkpoint_renames`` -- ``{old path: new path}`` of its param subtrees
(GPT-2's blocks when GPT-2 became a configuration of the decoder family: ``decoder/layer/ln1`` ->
``decoder/layer/input_norm``). A restore whose checkpoint holds the old names reads it into a
target renamed back to them, then renames what it read forward. The same renames apply wherever
the params' tree appears again -- inside the optimizer state (Adam's moments) -- because a rename
matches the *end* of a dict path: ``opt_state/.../mu/decoder/layer/ln1`` ends with the old path.
"""

from __future__ import annotations

from typing import Any, Mapping, Tuple


def renamed(tree: Any, renames: Mapping[str, str]) -> Any:
    """``tree`` with every dict key whose path ends with an old path of ``renames`` renamed to
    the new one's last segment (its parent path must match too). Tuples, lists and named tuples
    (optax states) are walked; other leaves are kept."""
    rules = [(_split(old), _split(new)) for old, new in renames.items()]
    for old, new in rules:
        if old[:-1] != new[:-1]:
            raise ValueError(f"a rename moves only the last segment: {old} -> {new}")
    return _walk(tree, (), rules)


def reversed_renames(renames: Mapping[str, str]) -> Mapping[str, str]:
    """New -> old: a target in this version's names renamed to a checkpoint's older ones."""
    return {new: old for old, new in renames.items()}


def _split(path: str) -> Tuple[str, ...]:
    return tuple(part for part in path.split("/") if part)


def _walk(tree: Any, path: Tuple[str, ...], rules) -> Any:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            name = key
            for old, new in rules:
                if str(key) == old[-1] and path[len(path) - len(old) + 1:] == old[:-1] \
                        and len(path) >= len(old) - 1:
                    name = new[-1]
            out[name] = _walk(value, path + (str(name),), rules)
        return out
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # A named tuple (optax state).
        return type(tree)(*(_walk(v, path, rules) for v in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_walk(v, path, rules) for v in tree)
    return tree
