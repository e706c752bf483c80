"""The seed's explicit pipeline stages: ``Stage(name, param_filter, fwd)``, one per pipe device.

Where the stacked path cuts one ``Repeat`` stack into equal slices, explicit stages may differ in
everything -- a conv stage feeding a dense stage, say. Each stage owns the params whose paths match
its ``param_filter`` globs (``owners``) and runs ``fwd(params_subset, x) -> y``. How they run
through a schedule is ``modules/explicit_stages.py`` (the model's pipeline parts).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable, Dict, List, Sequence

import jax

from titanax import errors
from titanax.parallel.sharding import path_string


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage: its name, the param path globs it owns, and its forward."""

    # Shown in errors and explain().
    name: str
    # fnmatch globs over param paths ("conv*", "dense/*"); a param belongs to the first stage
    # whose filter matches, and every param must belong to a stage.
    param_filter: Sequence[str]
    # (params_subset, x) -> y: params_subset keeps the param tree's nesting, pruned to this
    # stage's leaves; x is the microbatch (stage 0) or the previous stage's output. It gets no
    # PRNG key and no is_training: explicit stages run deterministic layers (no dropout), the
    # same in training and in evaluation.
    fwd: Callable[[Any, Any], Any]

    def __post_init__(self):
        where = f"plan.pipeline_parallel.stages[{self.name!r}]"
        if isinstance(self.param_filter, str) or not self.param_filter or not all(
                isinstance(p, str) for p in self.param_filter):
            raise errors.PlanError(
                f"param_filter must be a non-empty list of glob strings, got "
                f"{self.param_filter!r}", path=f"{where}.param_filter",
                suggestion="e.g. param_filter=['conv0/*', 'conv1/*']")
        if not callable(self.fwd):
            raise errors.PlanError(f"fwd must be callable, got {self.fwd!r}",
                                   path=f"{where}.fwd",
                                   suggestion="pass a function (params_subset, x) -> y")

    def __repr__(self) -> str:  # Shown in config dumps and resume diffs.
        name = getattr(self.fwd, "__qualname__", type(self.fwd).__name__)
        return (f"Stage(name={self.name!r}, param_filter={list(self.param_filter)!r}, "
                f"fwd={getattr(self.fwd, '__module__', '?')}.{name})")


def owners(params: Any, stages: Sequence[Stage]) -> Dict[str, int]:
    """``{param path: index of the stage that owns it}``, checked: every param owned, no stage
    without params."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    owned: Dict[str, int] = {}
    unowned: List[str] = []
    for path, _ in flat:
        name = path_string(path)
        for index, stage in enumerate(stages):
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in stage.param_filter):
                owned[name] = index
                break
        else:
            unowned.append(name)
    if unowned:
        raise errors.PlanError(
            f"{len(unowned)} param(s) belong to no stage: {', '.join(unowned[:8])}",
            path="plan.pipeline_parallel.stages",
            suggestion="add globs matching them to a stage's param_filter (e.g. "
                       f"{unowned[0].split('/')[0]!r} + '/*')")
    empty = [s.name for i, s in enumerate(stages) if i not in owned.values()]
    if empty:
        raise errors.PlanError(f"stage(s) {', '.join(empty)} own no params",
                               path="plan.pipeline_parallel.stages",
                               suggestion="check their param_filter globs against the param "
                                          "paths (Plan.describe lists them)")
    return owned


def subset(params: Any, owned: Dict[str, int], index: int) -> Any:
    """The nested dict of ``params`` pruned to stage ``index``'s leaves."""
    def prune(tree, prefix):
        if isinstance(tree, dict):
            out = {}
            for key, value in tree.items():
                kept = prune(value, f"{prefix}{key}/")
                if kept is not None:
                    out[key] = kept
            return out or None
        return tree if owned.get(prefix[:-1]) == index else None

    return prune(params, "") or {}
