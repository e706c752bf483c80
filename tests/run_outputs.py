"""What a launched run leaves in its trainer directory, read back without Titanax: the rows of
its metrics.csv and the params of its newest checkpoint (plain Orbax, numpy arrays -- no engine,
nothing compiled; a checkpoint holds the canonical params whatever layout wrote them)."""

import csv
import os
from typing import Any, Dict, Tuple

import jax
import numpy as np


def metric_rows(trainer_dir: str) -> Dict[int, Dict[str, str]]:
    """``{step: row}`` of the steps metrics.csv logs a loss for."""
    with open(os.path.join(trainer_dir, "metrics.csv"), encoding="utf-8") as f:
        return {int(r["step"]): r for r in csv.DictReader(f) if r.get("loss")}


def metric_column(trainer_dir: str, name: str) -> Dict[int, float]:
    """``{step: value}`` of one metrics.csv column, at the steps that log it."""
    with open(os.path.join(trainer_dir, "metrics.csv"), encoding="utf-8") as f:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(f) if r.get(name)}


def newest_params(trainer_dir: str) -> Tuple[int, Any]:
    """``(step, params)`` of the newest checkpoint in ``trainer_dir``."""
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    folder = os.path.join(trainer_dir, "checkpoints")
    step = max(int(d) for d in os.listdir(folder) if d.isdigit())
    path = os.path.join(folder, str(step), "params")
    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.metadata(path).item_metadata.tree
        target = jax.tree_util.tree_map(lambda m: np.zeros(m.shape, m.dtype), tree)
        params = checkpointer.restore(path, target)
    assert len(jax.tree_util.tree_leaves(params)) > 4, path  # (A model's, not an empty tree.)
    return step, params
