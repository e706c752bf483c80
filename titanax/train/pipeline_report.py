"""What a pipeline plan does, in numbers: stages, layers per stage, microbatches, ticks, bubble,
and per-device memory -- the pipelined gradient computer's part of ``--explain``."""

from __future__ import annotations

import math
from typing import List, Optional

import numpy as np
from jax.sharding import PartitionSpec

from titanax.parallel import rules, sharding
from titanax.parallel.layout import Layout
from titanax.parallel.plan import PP
from titanax.parallel.stages import owners


def describe(pp: PP, *, layout: Layout, local_batch: Optional[int], itemsize: int,
             temp_bytes: Optional[int]) -> str:
    """A few lines for explain(): the schedule, its shape and its cost."""
    cfg = pp.config
    num_stages = int(layout.mesh_shape[cfg.axis])
    lines = (_explicit(pp, layout, num_stages, itemsize) if cfg.stages
             else _stacked(pp, layout, num_stages, itemsize))
    if local_batch is not None:
        count, ticks, bubble = pp.schedule_numbers(num_stages=num_stages, local_batch=local_batch)
        lines.append(f"  microbatches M = {count} of {cfg.microbatch_size} per data shard; "
                     f"{ticks} ticks per step; bubble {bubble:.1%}")
    if temp_bytes is not None:
        lines.append(f"  activations and scratch of the compiled step (temp): "
                     f"{temp_bytes / 2 ** 20:.2f} MiB per device")
    return "\n".join(lines)


def _stacked(pp: PP, layout: Layout, num_stages: int, itemsize: int) -> List[str]:
    cfg = pp.config
    prefix = cfg.stacked_layers.strip("/") + "/"
    params = sharding.flat_paths(layout.parameter_specs, is_leaf=rules.is_param_leaf)
    specs = sharding.flat_paths(layout.param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    stacked = [path for path in params if path.startswith(prefix)]
    shape = params[stacked[0]].shape
    num_layers = (layout.stack_view.canonical_shape(shape) if layout.stack_view else shape)[0]
    unsplit = sum(math.prod(params[p].shape) * itemsize for p in stacked)
    local = sum(math.prod(rules.local_shape(params[p].shape, specs[p], layout.mesh_shape))
                * itemsize for p in stacked)
    lines = [f"pipeline: schedule {cfg.schedule}, {num_stages} stages on axis {cfg.axis!r}, "
             f"{num_layers // num_stages} of {num_layers} layers per stage ({cfg.stacked_layers})"]
    virtual = cfg.virtual_stages if cfg.schedule == "circular" else 1
    if virtual > 1:
        per_slice = num_layers // (num_stages * virtual)
        lines.append(f"  {virtual} virtual stages per device: device s runs model stages "
                     f"s, s+{num_stages}, ... of {per_slice} layer(s) each; the stack is held "
                     f"as [{virtual}, {num_stages}, {per_slice}, ...] (checkpoints: "
                     f"[{num_layers}, ...])")
    lines.append(f"  stacked-layer params per device: {local / 2 ** 20:.2f} MiB "
                 f"(un-pipelined: {unsplit / 2 ** 20:.2f} MiB)")
    return lines


def _explicit(pp: PP, layout: Layout, num_stages: int, itemsize: int) -> List[str]:
    cfg = pp.config
    owned = owners(layout.parameter_specs, cfg.stages)
    flat = sharding.flat_paths(layout.parameter_specs, is_leaf=rules.is_param_leaf)
    lines = [f"pipeline: schedule {cfg.schedule}, {num_stages} explicit stages on axis "
             f"{cfg.axis!r} (lax.switch on the pipe index; every stage's params are "
             "replicated over it)"]
    for index, stage in enumerate(cfg.stages):
        paths = sorted(p for p, i in owned.items() if i == index)
        size = sum(int(np.prod(flat[p].shape)) * itemsize for p in paths)
        shown = ", ".join(paths[:4]) + (", ..." if len(paths) > 4 else "")
        lines.append(f"  stage {index} {stage.name!r}: {len(paths)} params, {size / 2 ** 10:.1f} "
                     f"KiB ({shown})")
    return lines

