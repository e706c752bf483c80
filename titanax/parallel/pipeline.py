"""Pipeline schedules in local view: stages on a mesh axis, microbatches passed by ``ppermute``.

These run inside the train step's ``shard_map`` (DESIGN section 7.1): every device of the pipe
axis holds one stage's params and runs the same tick loop; a tick's only collective is one
``ppermute`` that hands each stage's output to the next stage. Nothing here knows about data or
tensor parallelism -- they compose around it.

``gpipe``: a ``lax.scan`` over ``M + S - 1`` ticks. At tick ``t`` stage ``s`` works on microbatch
``t - s`` (idle, on zeros, when that is outside ``[0, M)``: every device issues the same
collectives every tick). Stage 0 reads microbatch ``t`` from the inputs; the last stage writes its
result for microbatch ``t - S + 1`` into the outputs. Backward is autodiff through the scan: the
transpose of the forward ring shift is the backward ring shift. With ``remat_ticks`` each tick's
body is rematerialised from its input (only tick inputs are saved), so activation memory does not
grow with the stage's depth. Bubble: ``(S - 1) / (M + S - 1)``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from titanax import errors
from titanax.parallel import collectives
from titanax.parallel.sharding import path_string


def gpipe(stage_fn: Callable[[Any, jax.Array, jax.Array], jax.Array], stage_params: Any,
          microbatches: jax.Array, *, axis: str, remat_ticks: bool = False) -> jax.Array:
    """Runs ``S`` pipeline stages over ``M`` microbatches (local view, inside shard_map).

    Args:
      stage_fn: ``(this stage's params, x, microbatch index) -> y`` with ``y`` shaped like ``x``
        (the activation that crosses stage boundaries); the index lets a stage derive its
        dropout key from the microbatch, so masks do not depend on the schedule.
      stage_params: this device's stage params (whatever ``stage_fn`` takes).
      microbatches: ``[M, ...]``; read on stage 0 only (other stages may hold anything).
      axis: the pipeline mesh axis; its size is the number of stages ``S``.
      remat_ticks: rematerialise each tick in backward, saving only tick inputs.

    Returns:
      ``[M, ...]`` outputs of the last stage, valid on the last stage (zeros elsewhere).
    """
    num_stages = collectives.axis_size(axis)
    count = microbatches.shape[0]
    if count < num_stages:
        raise errors.PlanError(
            f"{count} microbatches for {num_stages} stages: the pipeline never fills",
            path="plan.pipeline_parallel.microbatch_size",
            suggestion=f"use at least {num_stages} microbatches per data shard")
    stage = collectives.axis_index(axis)
    shift = [(i, i + 1) for i in range(num_stages - 1)]
    microbatches = collectives.cast_varying(microbatches, axis)
    zero = jnp.zeros_like(microbatches[0])

    def tick(carry, t):
        received, outputs = carry
        fresh = jax.lax.dynamic_index_in_dim(microbatches, jnp.minimum(t, count - 1),
                                             keepdims=False)
        x = jnp.where(stage == 0, jnp.where(t < count, fresh, zero), received)
        y = stage_fn(stage_params, x, jnp.clip(t - stage, 0, count - 1))
        done = t - (num_stages - 1)
        write = (stage == num_stages - 1) & (done >= 0)
        slot = jnp.clip(done, 0, count - 1)
        current = jax.lax.dynamic_index_in_dim(outputs, slot, keepdims=False)
        outputs = jax.lax.dynamic_update_index_in_dim(outputs, jnp.where(write, y, current),
                                                      slot, 0)
        return (jax.lax.ppermute(y, axis, shift), outputs), None

    if remat_ticks:
        tick = jax.checkpoint(tick, prevent_cse=False)
    init = (zero, jnp.zeros_like(microbatches))
    (_, outputs), _ = jax.lax.scan(tick, init, jnp.arange(count + num_stages - 1))
    return outputs


def bubble_fraction(*, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a GPipe / circular schedule: (S - 1) / (v M + S - 1)."""
    return (num_stages - 1) / (virtual_stages * num_microbatches + num_stages - 1)


def stage_param_specs(param_specs: Any, *, stacked_layers: str, pipe_axis: str) -> Any:
    """The PP transform of the param-spec pipeline: ``pipe_axis`` on the layer dimension of every
    param under ``stacked_layers`` (global shape unchanged: ``[L, ...]``, so a checkpoint
    restores with or without pipelining); every other param replicated over it."""
    prefix = stacked_layers.strip("/") + "/"
    found = []

    def transform(path, spec):
        name = path_string(path)
        if not name.startswith(prefix):
            return spec
        found.append(name)
        entries = tuple(spec)
        if entries and entries[0] is not None:
            raise errors.ShardingError(
                f"the layer dimension of {name} is already split over {entries[0]!r}",
                path=name, suggestion="the pipeline needs the stacked layer dimension; remove "
                "the rule that splits it")
        return PartitionSpec(pipe_axis, *entries[1:])

    specs = jax.tree_util.tree_map_with_path(transform, param_specs,
                                             is_leaf=lambda x: isinstance(x, PartitionSpec))
    if not found:
        raise errors.PlanError(
            f"no params under {stacked_layers!r} to split into pipeline stages",
            path="plan.pipeline_parallel.stacked_layers",
            suggestion="name the Repeat stack's param path, e.g. 'decoder/layer' for GPT")
    return specs
