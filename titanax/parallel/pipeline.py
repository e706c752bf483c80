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

``circular``: the same tick loop with ``v`` stage slices per device ("virtual stages", Narayanan
et al. 2021's interleaving applied to GPipe): the microbatches go round the ring ``v`` times, each
round through the next slice of every device; ``vM + S - 1`` ticks, each ``1/v`` of a GPipe
tick's work, so the bubble shrinks to ``(S - 1) / (vM + S - 1)`` at the price of ``v`` times the
ppermutes. Device ``s`` holds model stages ``c = r S + s`` for ``r = 0 .. v - 1`` (leaf ``r`` of
the stage params' leading dimension); microbatch ``m`` in round ``r`` is stream item
``i = r M + m``, which device ``s`` works on at tick ``t = i + s``. What the last device computes
in a round that is not the last goes round the ring to device 0, which keeps it in a buffer of M
activations until round ``r + 1`` reaches that microbatch, ``M - S + 1`` ticks after it arrives:
``M >= S`` is all the schedule needs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from titanax import errors
from titanax.parallel import collectives
from titanax.parallel.sharding import path_string
from titanax.utils.dtypes import wide_float


def gpipe(stage_fn: Callable[..., jax.Array], stage_params: Any, microbatches: jax.Array, *,
          axis: str, remat_ticks: bool = False, with_summaries: bool = False) -> Any:
    """Runs ``S`` pipeline stages over ``M`` microbatches (local view, inside shard_map).

    Args:
      stage_fn: ``(this stage's params, x, microbatch index, stage index) -> y`` with ``y``
        shaped like ``x`` (the activation that crosses stage boundaries); the indices let a stage
        derive its dropout key from the microbatch and its layers' place in the model, so masks
        do not depend on the schedule.
      stage_params: this device's stage params (whatever ``stage_fn`` takes).
      microbatches: ``[M, ...]``; read on stage 0 only (other stages may hold anything).
      axis: the pipeline mesh axis; its size is the number of stages ``S``.
      remat_ticks: rematerialise each tick in backward, saving only tick inputs.

    Returns:
      ``[M, ...]`` outputs of the last stage, valid on the last stage (zeros elsewhere); with
      ``with_summaries`` also the stages' summaries (see ``circular``).
    """
    return circular(stage_fn, stage_params, microbatches, axis=axis, virtual_stages=1,
                    remat_ticks=remat_ticks, with_summaries=with_summaries)


def circular(stage_fn: Callable[..., jax.Array], stage_params: Any, microbatches: jax.Array, *,
             axis: str, virtual_stages: int, remat_ticks: bool = False,
             with_summaries: bool = False) -> Any:
    """GPipe with ``v = virtual_stages`` stage slices per device (the module docstring; ``v = 1``
    is plain GPipe). ``stage_fn(params, x, microbatch, c)`` runs model stage ``c``; with
    ``with_summaries`` it returns ``(y, {name: scalar})`` and the result is ``(outputs,
    summaries)``: each summed over this device's real ticks and divided by ``vMS`` (summed over
    the pipe axis: the mean over every stage and microbatch)."""
    num_stages = collectives.axis_size(axis)
    count = microbatches.shape[0]
    check_fills(num_microbatches=count, num_stages=num_stages)
    rounds = virtual_stages
    stage = collectives.axis_index(axis)
    ring = [(i, (i + 1) % num_stages) for i in range(num_stages if rounds > 1 else num_stages - 1)]
    microbatches = collectives.cast_varying(microbatches, axis)
    zero = jnp.zeros_like(microbatches[0])
    items = rounds * count

    def run_stage(all_params, x, microbatch, round_):
        params = index(all_params, round_) if rounds > 1 else all_params
        return stage_fn(params, x, microbatch, round_ * num_stages + stage)

    run_stage = _rematerialised(run_stage, remat_ticks=remat_ticks, rounds=rounds)

    def tick(carry, t):
        received, looped, outputs, summed = carry
        item = jnp.clip(t - stage, 0, items - 1)
        microbatch, round_ = item % count, item // count
        fresh = index(microbatches, microbatch)
        if rounds > 1:  # Rounds after the first start from what came round the ring.
            fresh = jnp.where(round_ == 0, fresh, index(looped, microbatch))
        first_valid = jnp.where(t < items, fresh, zero)
        x = jnp.where(stage == 0, first_valid, received)
        y = run_stage(stage_params, x, microbatch, round_)
        if with_summaries:
            y, summaries = y
            real = (t - stage >= 0) & (t - stage < items)
            summed = {k: v + jnp.where(real, summaries[k], 0.0) for k, v in summed.items()}
        done = t - (num_stages - 1)  # The last device's item this tick.
        last_round = (done >= 0) & (done // count == rounds - 1)
        outputs = put(outputs, jnp.clip(done, 0, items - 1) % count, y,
                      (stage == num_stages - 1) & last_round)
        sent = jax.lax.ppermute(y, axis, ring)
        if rounds > 1:  # Device 0 keeps what the last device finished in a round before the last.
            looped = put(looped, jnp.clip(done, 0, items - 1) % count, sent,
                         (stage == 0) & (done >= 0) & (done // count < rounds - 1))
        return (sent, looped, outputs, summed), None

    looped = jnp.zeros_like(microbatches) if rounds > 1 else jnp.zeros((0,), zero.dtype)
    summed = (_summary_sums(run_stage, stage_params, zero) if with_summaries else {})
    init = (zero, collectives.cast_varying(looped, axis), jnp.zeros_like(microbatches), summed)
    (_, _, outputs, summed), _ = jax.lax.scan(tick, init, jnp.arange(items + num_stages - 1))
    if with_summaries:
        return outputs, {k: v / (items * num_stages) for k, v in summed.items()}
    return outputs


def _summary_sums(run_stage: Callable, stage_params: Any, zero: jax.Array) -> Dict[str, Any]:
    """Zero accumulators for the stage's summaries (names and shapes from the stage itself),
    varying over every manual axis as the summaries are."""
    first = jax.eval_shape(run_stage, stage_params, zero, 0, 0)[1]
    return {k: collectives.cast_varying(jnp.zeros(v.shape, wide_float(v.dtype)),
                                        collectives.manual_axes())
            for k, v in first.items()}


def _rematerialised(run_stage: Callable, *, remat_ticks: bool, rounds: int) -> Callable:
    """What a tick of the circular schedule saves for backward."""
    if remat_ticks:  # Only the stage's input is saved; the ring buffers are never residuals.
        return jax.checkpoint(run_stage, prevent_cse=False)
    if rounds > 1:
        # The round's params are a slice taken per tick: saved as a residual it would keep a
        # copy of them per tick (M copies of the device's layers). Keep the matmul outputs (the
        # activations) and recompute the rest, the slice included, in backward.
        return jax.checkpoint(run_stage, prevent_cse=False,
                              policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    return run_stage


def index(tree: Any, i) -> Any:
    """Entry ``i`` of every leaf's leading dimension (a traced ``i``)."""
    return jax.tree_util.tree_map(
        lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def put(buffer: jax.Array, i, value: jax.Array, write) -> jax.Array:
    """``buffer`` with entry ``i`` set to ``value`` where ``write`` holds."""
    current = jax.lax.dynamic_index_in_dim(buffer, i, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(write, value, current), i, 0)


def check_fills(*, num_microbatches: int, num_stages: int) -> None:
    """Every schedule here runs any M >= S microbatches; fewer never fill the pipeline (the one
    check of it: ``Plan.check_batch_size`` calls it before compiling, the schedules again)."""
    if num_microbatches < num_stages:
        raise errors.PlanError(
            f"{num_microbatches} microbatches for {num_stages} stages: the pipeline never fills",
            path="plan.pipeline_parallel.microbatch_size",
            suggestion=f"use a smaller microbatch_size (at least {num_stages} microbatches per "
                       "data shard; more shrinks the bubble)")


def bubble_fraction(*, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a GPipe / circular schedule: (S - 1) / (v M + S - 1)."""
    return (num_stages - 1) / (virtual_stages * num_microbatches + num_stages - 1)


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """The PP transform of the layout pipeline (parallel/layout.py): ``pipe_axis`` on the layer
    dimension of every param under ``stacked_layers`` (global shape unchanged: ``[L, ...]``, so
    a checkpoint restores with or without pipelining); every other param replicated over it."""

    # Param path of the stacked (Repeat) layers.
    stacked_layers: str
    pipe_axis: str
    name: str = "PP stages"

    def apply(self, layout):
        prefix = self.stacked_layers.strip("/") + "/"
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
                    path=name, suggestion="the pipeline needs the stacked layer dimension; "
                    "remove the rule that splits it")
            return PartitionSpec(self.pipe_axis, *entries[1:])

        specs = jax.tree_util.tree_map_with_path(transform, layout.param_specs,
                                                 is_leaf=lambda x: isinstance(x, PartitionSpec))
        if not found:
            raise errors.PlanError(
                f"no params under {self.stacked_layers!r} to split into pipeline stages",
                path="plan.pipeline_parallel.stacked_layers",
                suggestion="name the Repeat stack's param path, e.g. 'decoder/layer' for GPT")
        layers = stacked_layer_count(layout.parameter_specs, prefix)
        stages = int(layout.mesh_shape[self.pipe_axis])
        if layers % stages:
            raise errors.PlanError(
                f"the stack under {prefix!r} holds {layers} stacked layer(s) (where the model "
                f"repeats a layer pattern, one per repetition), which do not split evenly into "
                f"{stages} pipeline stages", path="model.num_layers",
                suggestion=f"make the stacked count a multiple of {stages} (num_layers, or with a "
                "layer_pattern num_layers // len(layer_pattern)), or use another size for the "
                "pipe axis")
        return layout.evolve(self.name, param_specs=specs)


def stacked_layer_count(parameter_specs: Any, prefix: str) -> int:
    """L: the leading dimension of the params under ``prefix`` (0 when there are none)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(
            parameter_specs, is_leaf=lambda x: hasattr(x, "shape"))[0]:
        if path_string(path).startswith(prefix):
            return int(leaf.shape[0])
    return 0
