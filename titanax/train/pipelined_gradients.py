"""The pipelined gradient computer: a GPT's decoder stack split into stages over the pipe axis.

The third gradient computer of DESIGN section 7 (after the plain and the microbatched one). The
``Repeat`` stack named by ``PP.stacked_layers`` keeps its canonical global layout ``[L, ...]``
with the pipe axis on the layer dimension, so pipe rank ``s`` holds layers
``s L/S .. (s+1) L/S - 1`` and a checkpoint restores with or without pipelining. Per step, on
every data shard:

1. the batch is cut into M = local batch / microbatch_size microbatches and embedded (the
   embedding is replicated over ``pipe``; only stage 0's result enters the pipeline);
2. ``parallel.pipeline.gpipe`` runs the stages over the microbatches with one ``ppermute`` per
   tick (autodiff gives the backward; ``checkpoint_ratio > 0`` rematerialises each tick);
3. the last stage runs the final norm, the LM head and the loss on every microbatch; the other
   stages' loss is zero, so the loss is a *partial sum* over ``pipe`` (declared: ``sum_over``),
   and params replicated over ``pipe`` (embeddings, final norm) get their gradient summed there
   by the reducer -- the tied embedding collects both its stage-0 and its head contributions.

GPipe is the schedule implemented so far; circular and 1F1B are refused by the engine with a
PlanError until they run. Data and tensor parallelism compose around it (TP collectives inside a
stage stay inside the tick loop; the data-axis reduction stays once per step, after it).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp

from titanax import errors
from titanax.modules import functional
from titanax.modules.base_layer import BaseLayer
from titanax.parallel import collectives, pipeline
from titanax.train.gradients import LocalGradients, LossRelation
from titanax.train.precision import Precision


class PipelinedGradients:
    """Gradients of a GPT-style model (``embed`` / ``decoder`` / ``head_loss``) over a pipeline."""

    def __init__(self, *, model: BaseLayer, precision: Precision, mesh_shape: Mapping[str, int],
                 data_axis: Optional[str], pipe_axis: str, microbatch_size: int,
                 remat_ticks: bool = False):
        self.model = model
        self.precision = precision
        self.mesh_shape = dict(mesh_shape)
        self.data_axis = data_axis
        self.pipe_axis = pipe_axis
        self.microbatch_size = microbatch_size
        self.remat_ticks = remat_ticks
        stages = self.mesh_shape[pipe_axis]
        layers = model.decoder.config.num_layers
        if layers % stages:
            raise errors.PlanError(
                f"{layers} layers do not split evenly into {stages} pipeline stages",
                path="model.num_layers", suggestion=f"use a multiple of {stages} layers, or "
                "another size for the pipe axis")
        # One stage's slice of the stack: the same layer, L/S times.
        self.stage = model.decoder.config.clone(name="decoder",
                                                num_layers=layers // stages).instantiate()
        self.loss_relation = LossRelation(
            mean_over=(data_axis,) if data_axis else (),
            copy_over=tuple(a for a in self.mesh_shape if a not in (data_axis, pipe_axis)),
            sum_over=(pipe_axis,))

    def __call__(self, params: Any, batch: Any, key: jax.Array, *,
                 loss_scale: Optional[jax.Array] = None) -> LocalGradients:
        grad_fn = jax.value_and_grad(self._objective, has_aux=True)
        (_, (loss, aux)), grads = grad_fn(params, batch, key, loss_scale)
        return LocalGradients(grads=grads, loss=loss, aux=aux, summaries={})

    def forward_loss(self, params: Any, batch: Any, key: Optional[jax.Array],
                     *, is_training: bool) -> Tuple[jax.Array, Dict[str, jax.Array]]:
        """``(loss, aux)`` of the pipelined model: the loss is this device's partial sum over
        the pipe axis (the last stage's mean over its data shard, zero elsewhere)."""
        cfg_stages = self.mesh_shape[self.pipe_axis]
        local = jax.tree_util.tree_leaves(batch)[0].shape[0]
        if local % self.microbatch_size:
            raise errors.PlanError(
                f"microbatches of {self.microbatch_size} do not divide the per-data-shard batch "
                f"of {local}", path="plan.pipeline_parallel.microbatch_size",
                suggestion="choose a microbatch_size that divides the per-shard batch")
        count = local // self.microbatch_size
        keys = _keys(key, 3)
        embedded, _ = functional(self.model, keys[0], params, (batch["input_ids"],),
                                 method="embed", is_training=is_training)
        microbatches = embedded.reshape((count, self.microbatch_size) + embedded.shape[1:])
        stage_index = collectives.axis_index(self.pipe_axis)

        def stage_fn(stage_params, x):
            stage_key = (None if keys[1] is None
                         else jax.random.fold_in(keys[1], stage_index))
            return functional(self.stage, stage_key, stage_params, (x,),
                              is_training=is_training)[0]

        decoded = pipeline.gpipe(stage_fn, params["decoder"], microbatches, axis=self.pipe_axis,
                                 remat_ticks=self.remat_ticks)
        decoded = decoded.reshape(embedded.shape)
        (loss, aux), _ = functional(self.model, keys[2], params, (decoded, batch),
                                    method="head_loss", is_training=is_training)
        last = stage_index == cfg_stages - 1
        loss = jnp.where(last, loss.astype(jnp.float32), 0.0)
        aux = {k: jnp.where(last, v, jnp.zeros_like(v)) for k, v in aux.items()}
        return loss, aux

    def _objective(self, params, batch, key, loss_scale):
        compute_params = self.precision.cast_for_compute(params)
        inputs = self.precision.cast_for_compute(batch)
        loss, aux = self.forward_loss(compute_params, inputs, key, is_training=True)
        objective = loss / self._copies_seen_by_autodiff(loss)
        if loss_scale is not None:
            objective = objective * loss_scale
        return objective, (loss, aux)

    def _copies_seen_by_autodiff(self, loss: jax.Array) -> int:
        varying = collectives.varying_axes(loss)
        copies = 1
        for axis in self.loss_relation.copy_over:
            copies *= self.mesh_shape[axis] if axis in varying else 1
        return copies


def _keys(key: Optional[jax.Array], count: int):
    if key is None:
        return [None] * count
    return list(jax.random.split(key, count))
