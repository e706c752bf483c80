"""Which params the optimizer trains: the step's view of frozen weights.

A param whose ParameterSpec says ``trainable=False`` (a LoRA run's base weights:
modules/lora.py) is part of the state and of every forward, and of nothing else: the gradient
computer differentiates the trainable params only (no backward through a frozen weight's own
gradient), the reducer plans and reduces their gradients only, the optimizer holds state for them
only, and the update writes them only -- the frozen arrays leave the step as they entered it,
bit for bit.

``Trainable`` holds the mask (a tree of bools shaped like the params) and cuts any tree shaped
like the params down to its trainable part (``select``) or puts a trainable part back into a
whole tree (``merge``). The trees are Titanax param trees: nested dicts. With every param
trainable both are the identity, so a run without frozen params compiles the same program.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional

import jax

from titanax import errors


@dataclasses.dataclass(frozen=True)
class Trainable:
    """The trainable part of param-shaped trees."""

    # A tree of bools shaped like the params (nested dicts): True where trained.
    mask: Any

    @classmethod
    def from_specs(cls, parameter_specs: Any, *, is_leaf: Callable[[Any], bool]) -> "Trainable":
        """The mask of ParameterSpecs' ``trainable`` flags."""
        return cls(mask=jax.tree_util.tree_map(lambda s: bool(getattr(s, "trainable", True)),
                                               parameter_specs, is_leaf=is_leaf))

    @property
    def everything(self) -> bool:
        """Every param is trained (select and merge are then the identity)."""
        return all(jax.tree_util.tree_leaves(self.mask))

    def select(self, tree: Any) -> Any:
        """``tree`` (shaped like the params, its leaves any objects) cut to its trainable
        leaves; dicts left empty are dropped."""
        if self.everything:
            return tree
        return _select(tree, self.mask, path="")

    def merge(self, whole: Any, part: Any) -> Any:
        """``whole`` with the leaves of ``part`` (a ``select`` of a tree like it) in place."""
        if self.everything:
            return part
        return _merge(whole, part, self.mask, path="")

    def count(self, tree: Any, size: Callable[[Any], int]) -> Dict[str, int]:
        """``{"trainable": ..., "frozen": ...}`` sums of ``size(leaf)`` (--explain)."""
        sizes = {"trainable": 0, "frozen": 0}
        for leaf, trained in zip(jax.tree_util.tree_leaves(tree),
                                 jax.tree_util.tree_leaves(self.mask)):
            sizes["trainable" if trained else "frozen"] += size(leaf)
        return sizes


def _select(tree: Any, mask: Any, *, path: str) -> Optional[Any]:
    if isinstance(mask, bool):
        return tree
    if not isinstance(mask, dict) or not isinstance(tree, dict):
        raise errors.StepError(f"the params at {path or '/'} are not a dict of params, so the "
                               "frozen ones cannot be set apart", path="lora")
    out = {}
    for name, sub in mask.items():
        if not _any(sub):
            continue
        out[name] = _select(tree[name], sub, path=f"{path}/{name}")
    return out


def _merge(whole: Any, part: Any, mask: Any, *, path: str) -> Any:
    if isinstance(mask, bool):
        return part if mask else whole
    out = dict(whole)
    for name, sub in mask.items():
        if _any(sub):
            out[name] = _merge(whole[name], part[name], sub, path=f"{path}/{name}")
    return out


def _any(mask: Any) -> bool:
    return any(jax.tree_util.tree_leaves(mask))
