"""What a pipeline plan does, in numbers: stages, layers per stage, microbatches, ticks, bubble,
and per-device memory -- for ``explain()`` / ``--explain`` and the step metrics."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

from titanax.parallel import one_f_one_b, pipeline


def schedule_numbers(pp_config: Any, *, num_stages: int, local_batch: int):
    """(microbatches M, ticks, bubble fraction) of the configured schedule."""
    count = local_batch // pp_config.microbatch_size
    if pp_config.schedule == "1f1b":
        table = one_f_one_b.build_schedule(num_stages, count)
        return count, table.num_ticks, table.bubble()
    ticks = pp_config.virtual_stages * count + num_stages - 1
    return count, ticks, pipeline.bubble_fraction(
        num_stages=num_stages, num_microbatches=count, virtual_stages=pp_config.virtual_stages)


def describe(pp_config: Any, *, num_stages: int, num_layers: int, local_batch: Optional[int],
             stacked_bytes_per_device: int, unsplit_stacked_bytes: int,
             temp_bytes: Optional[int]) -> str:
    """A few lines for explain(): the schedule, its shape and its cost."""
    lines = [f"pipeline: schedule {pp_config.schedule}, {num_stages} stages on axis "
             f"{pp_config.axis!r}, {num_layers // num_stages} of {num_layers} layers per stage "
             f"({pp_config.stacked_layers})"]
    virtual = pp_config.virtual_stages if pp_config.schedule == "circular" else 1
    if virtual > 1:
        per_slice = num_layers // (num_stages * virtual)
        lines.append(f"  {virtual} virtual stages per device: device s runs model stages "
                     f"s, s+{num_stages}, ... of {per_slice} layer(s) each; the stack is held "
                     f"as [{virtual}, {num_stages}, {per_slice}, ...] (checkpoints: "
                     f"[{num_layers}, ...])")
    lines.append(f"  stacked-layer params per device: {stacked_bytes_per_device / 2 ** 20:.2f} MiB "
                 f"(un-pipelined: {unsplit_stacked_bytes / 2 ** 20:.2f} MiB)")
    return "\n".join(lines + _shape_and_temp(pp_config, num_stages, local_batch, temp_bytes))


def describe_stages(pp_config: Any, *, num_stages: int,
                    stages: Sequence[Tuple[str, Sequence[str], int]],
                    local_batch: Optional[int], temp_bytes: Optional[int]) -> str:
    """explain() for the seed's explicit stages: ``stages`` is (name, param paths, bytes)."""
    lines = [f"pipeline: schedule {pp_config.schedule}, {num_stages} explicit stages on axis "
             f"{pp_config.axis!r} (lax.switch on the pipe index; every stage's params are "
             "replicated over it)"]
    for index, (name, paths, size) in enumerate(stages):
        shown = ", ".join(paths[:4]) + (", ..." if len(paths) > 4 else "")
        lines.append(f"  stage {index} {name!r}: {len(paths)} params, {size / 2 ** 10:.1f} KiB "
                     f"({shown})")
    return "\n".join(lines + _shape_and_temp(pp_config, num_stages, local_batch, temp_bytes))


def _shape_and_temp(pp_config, num_stages, local_batch, temp_bytes):
    lines = []
    if local_batch is not None:
        count, ticks, bubble = schedule_numbers(pp_config, num_stages=num_stages,
                                                local_batch=local_batch)
        lines.append(f"  microbatches M = {count} of {pp_config.microbatch_size} per data shard; "
                     f"{ticks} ticks per step; bubble {bubble:.1%}")
    if temp_bytes is not None:
        lines.append(f"  activations and scratch of the compiled step (temp): "
                     f"{temp_bytes / 2 ** 20:.2f} MiB per device")
    return lines
