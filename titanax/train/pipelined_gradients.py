"""The pipelined gradient computer: a model's pipeline parts run through a schedule over ``pipe``.

The third gradient computer of DESIGN section 7 (after the plain and the microbatched one). The
model supplies its parts (``modules/pipeline_parts.py``: a stacked decoder's slices, or the seed's
explicit ``Stage`` list); the schedules (``parallel/pipeline.py``: GPipe and circular,
``parallel/one_f_one_b.py``: 1F1B) move activations between the stages and know nothing of the
model. Per step, on every data shard:

1. the batch is cut into M = local batch / microbatch_size microbatches (``Plan`` checked that
   they fill the pipeline) and each enters stage 0 through ``first_stage_input`` (for a decoder
   the embedding, replicated over ``pipe``; only stage 0's result enters the pipeline);
2. GPipe / circular: ``parallel.pipeline.circular`` runs the stages with one ``ppermute`` per
   tick, autodiff gives the backward (``checkpoint_ratio`` rematerialises that fraction of each
   stage's layers, the whole tick at 1); the last stage's outputs are reduce-scattered so that
   each pipe rank runs the head and the loss on M/S microbatches (when S divides M; else every
   rank runs them on all M and all but the last stage's result is masked to zero);
3. 1F1B: ``parallel.one_f_one_b`` runs the static table, the last stage running the head and
   the loss per microbatch inside the schedule.

Either way the loss on each rank is a *partial sum* over ``pipe`` (declared: ``sum_over``) of the
mean over the data shard's trained tokens (token-weighted over its microbatches; over the data
shards too, by a weight as in gradients.py, when there are several), and
params replicated over ``pipe`` (embeddings, final norm) get their gradient summed there by the
reducer -- a tied embedding collects both its stage-0 and its head contributions. Every layer
draws its dropout key from the microbatch and its index in the whole model, so all schedules
(and any number of stages) drop out the same units. Data and tensor parallelism compose around
them: TP collectives inside a stage stay inside the tick loop; the data-axis reduction stays once
per step, after it.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from titanax import errors
from titanax.modules.base_layer import BaseLayer
from titanax.modules.explicit_stages import ExplicitStages
from titanax.modules.pipeline_parts import PipelineParts, part_key, parts_of
from titanax.parallel import collectives, one_f_one_b, pipeline
from titanax.parallel.layout import Layout
from titanax.parallel.plan import PP
from titanax.train import pipeline_report
from titanax.train.gradients import (LocalGradients, LossRelation, loss_capacity,
                                     weighs_shards)
from titanax.train.param_gathering import ParamGathering
from titanax.train.precision import Precision
from titanax.train.trainable import Trainable
from titanax.utils.dtypes import at_least_float32, wide_float


class PipelinedGradients:
    """Gradients of a model over a pipeline on ``pipe_axis`` (see the module docstring)."""

    def __init__(self, *, model: BaseLayer, precision: Precision, mesh_shape: Mapping[str, int],
                 batch_axes: Sequence[str], pipeline: PP,
                 gathering: Optional[ParamGathering] = None,
                 trainable: Optional[Trainable] = None):
        """``pipeline``: the plan's PP part (axis, schedule, microbatch size, stages);
        ``trainable``: the params differentiated (None: all; train/trainable.py)."""
        cfg = pipeline.config
        self.trainable = trainable if trainable is not None and not trainable.everything \
            else None
        # FSDP (per_step): the stored shards, gathered once before the schedule runs.
        self.gathering = gathering
        self.plan_part = pipeline
        self.precision = precision
        self.mesh_shape = dict(mesh_shape)
        self.pipe_axis = cfg.axis
        self.num_stages = self.mesh_shape[cfg.axis]
        if self.num_stages < 2:
            raise errors.PlanError(
                f"the pipe axis {cfg.axis!r} has size {self.num_stages}: nothing to "
                "pipeline", path=f"mesh axis {cfg.axis!r}",
                suggestion="give the pipe axis 2 or more devices, or drop pipeline_parallel")
        self.microbatch_size = cfg.microbatch_size
        self.schedule = cfg.schedule
        self.virtual_stages = cfg.virtual_stages if cfg.schedule == "circular" else 1
        self.parts = self._parts(model, cfg.stages, cfg.checkpoint_ratio)
        self.remat_ticks = (cfg.checkpoint_ratio > 0 and cfg.schedule != "1f1b" if cfg.stages
                            else self.parts.remat_ticks)
        batch_axes = tuple(batch_axes)
        # Microbatches inside the pipeline are token-weighted already (``_weight``): only data
        # shards need a weight.
        self.weighted = weighs_shards(
            batch_shards=math.prod(self.mesh_shape[a] for a in batch_axes), pieces=1)
        self.loss_relation = LossRelation(
            mean_over=batch_axes,
            copy_over=tuple(a for a in self.mesh_shape if a not in batch_axes and a != cfg.axis),
            sum_over=(cfg.axis,))

    def schedule_metrics(self, local_rows: int) -> Dict[str, float]:
        """The schedule's idle fraction for batch shards of ``local_rows`` rows."""
        return {"pipeline_bubble": self.plan_part.schedule_numbers(
            num_stages=self.num_stages, local_batch=local_rows)[2]}

    def describe(self, *, layout: Layout, local_batch: Optional[int], itemsize: int,
                 temp_bytes: Optional[int]) -> Optional[str]:
        """--explain's pipeline part: the schedule, its shape and what it costs per device."""
        return pipeline_report.describe(self.plan_part, layout=layout, local_batch=local_batch,
                                        itemsize=itemsize, temp_bytes=temp_bytes)

    def _parts(self, model, stages, checkpoint_ratio) -> PipelineParts:
        if not stages:
            return parts_of(model, num_stages=self.num_stages,
                            virtual_stages=self.virtual_stages,
                            checkpoint_ratio=checkpoint_ratio, schedule=self.schedule)
        # (PP.layout_transforms refused what explicit stages cannot run, at build.)
        return ExplicitStages(model=model, stages=stages, num_stages=self.num_stages,
                              pipe_axis=self.pipe_axis)

    def __call__(self, params: Any, batch: Any, key: jax.Array, *,
                 loss_scale: Optional[jax.Array] = None) -> LocalGradients:
        if self.gathering is not None:
            params = self.gathering.gather_all(params)
        if self.schedule == "1f1b":
            return self._one_f_one_b(params, batch, key, loss_scale)
        objective, trainable = self._objective, self.trainable
        if trainable is not None:  # The frozen params enter as constants (as in gradients.py).
            whole = params
            objective = functools.partial(
                lambda trained, *args, f: f(trainable.merge(whole, trained), *args), f=objective)
            params = trainable.select(params)
        grad_fn = jax.value_and_grad(objective, has_aux=True)
        weight = self._shard_weight(batch)
        (_, (loss, aux, summaries)), grads = grad_fn(params, batch, key, loss_scale, weight)
        return LocalGradients(grads=grads, loss=loss, aux=aux, summaries=summaries,
                              weight=weight)

    def _for_counting(self, batch: Any) -> Any:
        """The batch's float entries (token weights) in float32 or wider -- the compute dtype's
        width when that is wider (float64 runs): counts summed in 16 bits would round."""
        dtype = wide_float(self.precision.compute_dtype)
        return jax.tree_util.tree_map(
            lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, batch)

    def _shard_weight(self, batch: Any) -> Optional[jax.Array]:
        """The data shard's trained tokens over its capacity (gradients.py), the same on every
        pipe rank; None when the batch is not split over devices."""
        if not self.weighted:
            return None
        count = at_least_float32(self.parts.loss_weight(self._for_counting(batch)))
        return count / loss_capacity(batch)

    def _microbatches(self, batch: Any) -> Tuple[int, Any]:
        count = jax.tree_util.tree_leaves(batch)[0].shape[0] // self.microbatch_size
        return count, jax.tree_util.tree_map(
            lambda x: x.reshape((count, self.microbatch_size) + x.shape[1:]), batch)

    def eval_loss(self, params: Any, batch: Any) -> Tuple[jax.Array, Dict[str, jax.Array]]:
        """``(loss, aux)`` of a forward pass in evaluation mode (the GPipe tick loop whatever
        the schedule), summed over the pipe axis: the mean over this data shard's rows."""
        loss, aux, _ = self._forward(self.precision.cast_for_compute(params),
                                     self.precision.cast_for_compute(batch), None,
                                     is_training=False)
        return collectives.psum((loss, aux), self.pipe_axis)

    def _forward(self, params, batch, key, *, is_training):
        """``(loss, aux, summaries)``; the summaries too are partial sums over ``pipe``."""
        count, microbatches = self._microbatches(batch)
        parts = self.parts.for_inputs(params, jax.tree_util.tree_map(lambda v: v[0],
                                                                     microbatches))
        outside, staged = parts.split_params(params)
        inputs = jax.vmap(lambda mb, m: parts.first_stage_input(outside, mb, m, key,
                                                                is_training))(
            microbatches, jnp.arange(count))

        def stage_fn(p, x, m, model_stage):
            return parts.run_stage(p, x, m, model_stage, key, is_training, microbatches)

        if self.virtual_stages > 1:  # Leaves [v, 1, L/(vS), ...]: this device's v slices.
            staged = jax.tree_util.tree_map(lambda x: x[:, 0], staged)
        decoded, summaries = pipeline.circular(
            stage_fn, staged, inputs, axis=self.pipe_axis, virtual_stages=self.virtual_stages,
            remat_ticks=self.remat_ticks, with_summaries=True)
        loss, aux, head_summaries = self._head(parts, outside, decoded, microbatches, batch,
                                               count, part_key(key, 0, 2), is_training)
        summaries.update(head_summaries)
        return loss, aux, summaries

    def _head(self, parts, outside, decoded, microbatches, batch, count, head_key, is_training):
        """The head and the loss of the last stage's outputs: spread over the pipe ranks when S
        divides M, else on every rank with all but the last stage's result masked out."""
        stages = self.num_stages
        stage_index = collectives.axis_index(self.pipe_axis)
        if count % stages == 0:
            # Hand each pipe rank M/S of the last stage's outputs (a reduce-scatter: the other
            # stages hold zeros); its transpose (an all-gather) returns the gradients.
            share = count // stages
            mine = collectives.reduce_scatter(decoded, self.pipe_axis, scatter_dimension=0)
            rows = jax.tree_util.tree_map(
                lambda x: jax.lax.dynamic_slice_in_dim(x, stage_index * share, share).reshape(
                    (share * self.microbatch_size,) + x.shape[2:]), microbatches)
            _, aux, summaries = parts.head_loss(
                outside, mine.reshape((share * self.microbatch_size,) + mine.shape[2:]), rows,
                head_key, is_training)
            # Token-weighted: this share's loss sum over the whole shard's weight (padding rows
            # weigh 0), so the partial sums over pipe add up to the one-device loss exactly.
            loss = at_least_float32(aux["loss_sum"]) / _weight(parts, self._for_counting(batch))
            return loss, aux, {k: v / stages for k, v in summaries.items()}
        local = jax.tree_util.tree_leaves(batch)[0].shape[0]
        decoded = decoded.reshape((local,) + decoded.shape[2:])
        loss, aux, summaries = parts.head_loss(outside, decoded, batch, head_key, is_training)
        last = stage_index == stages - 1
        return (jnp.where(last, at_least_float32(loss), 0.0),
                {k: jnp.where(last, v, jnp.zeros_like(v)) for k, v in aux.items()},
                {k: jnp.where(last, v, 0.0) for k, v in summaries.items()})

    def _one_f_one_b(self, params, batch, key, loss_scale) -> LocalGradients:
        """Gradients by the static 1F1B table (parallel/one_f_one_b.py), explicit vjp per stage."""
        precision, stages = self.precision, self.num_stages
        count, microbatches = self._microbatches(batch)
        compute_batches = precision.cast_for_compute(microbatches)
        parts = self.parts.for_inputs(precision.cast_for_compute(params),
                                      jax.tree_util.tree_map(lambda v: v[0], compute_batches))
        outside, staged = parts.split_params(params)
        # Frozen params (train/trainable.py) enter the stages' vjps as constants.
        stage_params, outside_params = _trained_views(self.trainable, parts, staged, outside)
        staged, outside = stage_params.select(staged), outside_params.select(outside)
        stage_index = collectives.axis_index(self.pipe_axis)
        total_weight = _weight(parts, self._for_counting(batch))
        shard_weight = self._shard_weight(batch)

        def row(m):
            return jax.tree_util.tree_map(lambda v: v[m], compute_batches)

        def run_stage(sp, x, m):
            return parts.run_stage(precision.cast_for_compute(stage_params.whole(sp)), x, m,
                                   stage_index, key, True, compute_batches)

        def head(op, decoded, m):
            _, aux, head_summaries = parts.head_loss(
                precision.cast_for_compute(outside_params.whole(op)), decoded,
                                                     row(m), part_key(key, m, 2), True)
            # Token-weighted over the shard (see _head), not a mean of microbatch means.
            loss = at_least_float32(aux["loss_sum"]) / total_weight
            # Summaries as partial sums over pipe of the mean over microbatches (the stages'
            # are the executor's, over microbatches and stages).
            summaries = {k: v / count for k, v in head_summaries.items()}
            return (self.loss_relation.objective(loss, self.mesh_shape, loss_scale,
                                                 weight=shard_weight),
                    (loss, aux, summaries))

        functions = one_f_one_b.StageFunctions(
            first_input=lambda op, m: parts.first_stage_input(
                precision.cast_for_compute(outside_params.whole(op)), row(m), m, key, True),
            run_stage=run_stage, head=head)
        result = one_f_one_b.one_f_one_b(functions, staged, outside, axis=self.pipe_axis,
                                         num_microbatches=count)
        grads = parts.join_grads(result.outside_grads, result.staged_grads)
        # The params' key order (the trainable ones').
        trained = self.trainable.select(params) if self.trainable is not None else params
        grads = {k: grads[k] for k in trained}
        return LocalGradients(grads=grads, loss=result.loss, aux=result.aux,
                              summaries=result.summaries, weight=shard_weight)

    def _objective(self, params, batch, key, loss_scale, weight):
        compute_params = self.precision.cast_for_compute(params)
        inputs = self.precision.cast_for_compute(batch)
        loss, aux, summaries = self._forward(compute_params, inputs, key, is_training=True)
        return (self.loss_relation.objective(loss, self.mesh_shape, loss_scale, weight=weight),
                (loss, aux, summaries))


def _weight(parts: PipelineParts, batch: Any) -> jax.Array:
    """What the data shard's loss is a mean over (never 0: an all-padding shard has loss 0)."""
    return jnp.maximum(at_least_float32(parts.loss_weight(batch)), 1e-12)


class _PartView:
    """One side of a pipeline's params (outside the stages, or staged) cut to its trainable
    part: ``select`` cuts a whole tree, ``whole`` puts the frozen part back around a cut one."""

    def __init__(self, trainable: Optional[Trainable], frozen: Any):
        self.trainable, self.frozen = trainable, frozen

    def select(self, tree: Any) -> Any:
        return tree if self.trainable is None else self.trainable.select(tree)

    def whole(self, part: Any) -> Any:
        return part if self.trainable is None else self.trainable.merge(self.frozen, part)


def _trained_views(trainable: Optional[Trainable], parts: PipelineParts, staged: Any,
                   outside: Any) -> Tuple[_PartView, _PartView]:
    """``(staged view, outside view)`` of the run's trainable params (both the identity when
    every param is trained)."""
    if trainable is None:
        return _PartView(None, staged), _PartView(None, outside)
    outside_mask, staged_mask = parts.split_params(trainable.mask)
    return (_PartView(Trainable(mask=staged_mask), staged),
            _PartView(Trainable(mask=outside_mask), outside))
