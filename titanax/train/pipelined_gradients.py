"""The pipelined gradient computer: a GPT's decoder stack split into stages over the pipe axis.

The third gradient computer of DESIGN section 7 (after the plain and the microbatched one). The
``Repeat`` stack named by ``PP.stacked_layers`` keeps its canonical global layout ``[L, ...]``
with the pipe axis on the layer dimension (GPipe, 1F1B: pipe rank ``s`` holds layers
``s L/S .. (s+1) L/S - 1``) or is held as the circular schedule's view (below); either way a
checkpoint holds ``[L, ...]`` and restores with or without pipelining. The seed's explicit
``Stage`` list runs through the same schedules (``parallel/stages.py``). Per step, on every data
shard:

1. the batch is cut into M = local batch / microbatch_size microbatches and embedded (the
   embedding is replicated over ``pipe``; only stage 0's result enters the pipeline);
2. ``parallel.pipeline.gpipe`` (or ``circular``, with ``v`` slices of the stack per device:
   the stack's leaves are then the view ``[v, S, L/(vS), ...]`` of ``parallel.interleaved_stack``)
   runs the stages over the microbatches with one ``ppermute`` per tick (autodiff gives the
   backward; ``checkpoint_ratio`` rematerialises that fraction of each stage's layers, the
   whole tick at 1);
3. GPipe: the last stage's outputs are reduce-scattered so that each pipe rank runs the final
   norm, the LM head and the loss on M/S microbatches (when S divides M; else every rank runs
   them on all M and all but the last stage's result is masked to zero); 1F1B: the last stage
   runs them per microbatch inside the schedule. Either way the
   loss on each rank is a *partial sum* over ``pipe`` (declared: ``sum_over``),
   and params replicated over ``pipe`` (embeddings, final norm) get their gradient summed there
   by the reducer -- the tied embedding collects both its stage-0 and its head contributions.

GPipe, circular (autodiff through the tick scan) and 1F1B (a static table, explicit vjp per
stage) run. Every layer draws its dropout key from the microbatch and its index in the whole
stack, so the three schedules (and any number of stages) drop out the same units. Data and tensor
parallelism compose around them (TP collectives inside a stage stay inside the tick loop; the
data-axis reduction stays once per step, after it).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from titanax import errors
from titanax.modules import functional
from titanax.modules.base_layer import BaseLayer
from titanax.parallel import collectives, one_f_one_b, pipeline
from titanax.parallel.stages import ExplicitStages
from titanax.modules.context import flat_summaries, refuse_state_updates
from titanax.train.gradients import LocalGradients, LossRelation
from titanax.train.precision import Precision


class StackedStages:
    """The parts of a GPT-style model (``embed`` / ``decoder`` Repeat stack / ``head_loss``):
    stage ``c`` runs layers ``c L/(vS) .. (c+1) L/(vS) - 1`` of the stack."""

    def __init__(self, *, model: BaseLayer, num_stages: int, virtual_stages: int,
                 checkpoint_ratio: float, schedule: str):
        missing = [name for name in ("embed", "head_loss", "decoder") if not hasattr(model, name)]
        if missing:
            raise errors.PlanError(
                f"{type(model).__qualname__} has no {', '.join(missing)}: the stacked path runs "
                "models built as embed -> decoder (a Repeat stack) -> head_loss, like GPT",
                path="plan.pipeline_parallel",
                suggestion="use a GPT-style model, or declare the stages explicitly "
                           "(PP.stages=[Stage(name, param_filter, fwd), ...])")
        self.model = model
        layers = model.decoder.config.num_layers
        if layers % num_stages:
            raise errors.PlanError(
                f"{layers} layers do not split evenly into {num_stages} pipeline stages",
                path="model.num_layers", suggestion=f"use a multiple of {num_stages} layers, or "
                "another size for the pipe axis")
        if layers % (num_stages * virtual_stages):
            raise errors.PlanError(
                f"{layers} layers do not split into {num_stages} stages x {virtual_stages} "
                "virtual stages", path="plan.pipeline_parallel.virtual_stages",
                suggestion=f"use a number of layers divisible by "
                           f"{num_stages * virtual_stages}, or fewer virtual stages")
        # One stage's slice of the stack: the same layer, L/(vS) times.
        self.layers_per_stage = layers // (num_stages * virtual_stages)
        self.stage_layer = model.decoder.config.clone(
            name="decoder", num_layers=self.layers_per_stage).instantiate()
        # checkpoint_ratio: all of a stage's layers -> the whole tick is rematerialised (only its
        # input saved); a fraction -> that many leading layers of each stage (rounded up) run
        # under jax.checkpoint (their insides recomputed in backward), the rest keep
        # activations. 1F1B recomputes each stage's forward in its backward anyway: nothing.
        if schedule == "1f1b":
            checkpoint_ratio = 0.0
        remat_layers = math.ceil(checkpoint_ratio * self.layers_per_stage - 1e-9)
        self.remat_ticks = remat_layers == self.layers_per_stage and checkpoint_ratio > 0
        self.remat_layers = 0 if self.remat_ticks else remat_layers
        if self.remat_layers:
            self.stage_parts = [model.decoder.config.clone(name="decoder", num_layers=n
                                                           ).instantiate()
                                for n in (self.remat_layers,
                                          self.layers_per_stage - self.remat_layers)]

    def prepare(self, params: Any, microbatch: Any) -> None:
        del params, microbatch

    @staticmethod
    def split(params: Any) -> Tuple[Any, Any]:
        return {k: v for k, v in params.items() if k != "decoder"}, params["decoder"]

    @staticmethod
    def join(top_grads: Any, stage_grads: Any) -> Any:
        return {**top_grads, "decoder": stage_grads}

    def embed(self, top: Any, microbatch: Any, index, key, is_training: bool) -> jax.Array:
        return functional(self.model, _part_key(key, index, 0), top,
                          (microbatch["input_ids"],), method="embed", is_training=is_training)[0]

    def stage(self, stage_params, x, index, model_stage, key, is_training, microbatches=None):
        """Model stage ``model_stage`` (layers from ``model_stage * L/(vS)``) on microbatch
        ``index``; each layer's dropout key depends on the microbatch and its place in the whole
        stack."""
        del microbatches
        first_layer = model_stage * self.layers_per_stage
        key = _part_key(key, index, 1)

        def run(part, params, x, first):
            y, collection = functional(part, key, params, {"x": x, "first_layer": first},
                                       is_training=is_training)
            if is_training:
                refuse_state_updates(collection, where="decoder")
            return y, flat_summaries(collection.summaries, "summaries/decoder")

        if not (self.remat_layers and is_training):
            return run(self.stage_layer, stage_params, x, first_layer)
        recomputed, kept = self.stage_parts
        split = self.remat_layers
        head = jax.tree_util.tree_map(lambda p: p[:split], stage_params)
        tail = jax.tree_util.tree_map(lambda p: p[split:], stage_params)
        x, early = jax.checkpoint(lambda p, x_in: run(recomputed, p, x_in, first_layer),
                                  prevent_cse=False)(head, x)
        y, late = run(kept, tail, x, first_layer + split)
        share = split / self.layers_per_stage  # Per-layer means, weighted by layer counts.
        return y, {k: share * early[k] + (1 - share) * late[k] for k in late}

    def head_loss(self, top: Any, outputs: jax.Array, rows: Any, key, is_training: bool):
        (loss, aux), collection = functional(self.model, key, top, (outputs, rows),
                                             method="head_loss", is_training=is_training)
        if is_training:
            refuse_state_updates(collection, where=f"{type(self.model).__qualname__}.head_loss")
        return loss, aux, flat_summaries(collection.summaries)

    @staticmethod
    def total_weight(batch: Dict[str, jax.Array]) -> jax.Array:
        return _token_weight(batch)


class PipelinedGradients:
    """Gradients of a model over a pipeline: the stacked path (a GPT's ``Repeat`` stack cut into
    equal stages) or the seed's explicit ``Stage`` list (``parallel/stages.py``)."""

    def __init__(self, *, model: BaseLayer, precision: Precision, mesh_shape: Mapping[str, int],
                 batch_axes: Sequence[str], pipe_axis: str, microbatch_size: int,
                 schedule: str = "1f1b", virtual_stages: int = 1,
                 checkpoint_ratio: float = 0.0, stages: Sequence[Any] = (),
                 gathering: Optional[Any] = None):
        # FSDP (per_step): the stored shards, gathered once before the schedule runs.
        self.gathering = gathering
        self.model = model
        self.precision = precision
        self.mesh_shape = dict(mesh_shape)
        # The axes the batch is split over (data; under HSDP data and the ZeRO axis).
        self.batch_axes = tuple(batch_axes)
        self.pipe_axis = pipe_axis
        if schedule not in ("gpipe", "circular", "1f1b"):
            raise errors.PlanError(f"unknown schedule {schedule!r}",
                                   path="plan.pipeline_parallel.schedule",
                                   suggestion="use 'gpipe', 'circular' or '1f1b'")
        num_stages = self.mesh_shape[pipe_axis]
        if num_stages < 2:
            raise errors.PlanError(
                f"the pipe axis {pipe_axis!r} has size {num_stages}: nothing to "
                "pipeline", path=f"mesh axis {pipe_axis!r}",
                suggestion="give the pipe axis 2 or more devices, or drop pipeline_parallel")
        self.microbatch_size = microbatch_size
        self.schedule = schedule
        self.virtual_stages = virtual_stages if schedule == "circular" else 1
        if stages:
            if self.virtual_stages > 1:
                raise errors.PlanError(
                    "explicit stages run one stage per device: virtual stages need the stacked "
                    "path", path="plan.pipeline_parallel.virtual_stages",
                    suggestion="set virtual_stages=1 (schedule gpipe or 1f1b), or pipeline a "
                               "Repeat stack (stages=[])")
            if 0.0 < checkpoint_ratio < 1.0:
                raise errors.PlanError(
                    f"checkpoint_ratio {checkpoint_ratio}: explicit stages are rematerialised "
                    "whole or not at all", path="plan.pipeline_parallel.checkpoint_ratio",
                    suggestion="use 0 or 1 (1: each tick recomputed from its input)")
            self.parts = ExplicitStages(model=model, stages=stages, num_stages=num_stages,
                                        pipe_axis=pipe_axis)
            self.remat_ticks = checkpoint_ratio > 0 and schedule != "1f1b"
        else:
            self.parts = StackedStages(model=model, num_stages=num_stages,
                                       virtual_stages=self.virtual_stages,
                                       checkpoint_ratio=checkpoint_ratio, schedule=schedule)
            self.remat_ticks = self.parts.remat_ticks
        self.loss_relation = LossRelation(
            mean_over=self.batch_axes,
            copy_over=tuple(a for a in self.mesh_shape
                            if a not in self.batch_axes and a != pipe_axis),
            sum_over=(pipe_axis,))

    def __call__(self, params: Any, batch: Any, key: jax.Array, *,
                 loss_scale: Optional[jax.Array] = None) -> LocalGradients:
        if self.gathering is not None:
            params = self.gathering.gather_all(params)
        if self.schedule == "1f1b":
            return self._one_f_one_b(params, batch, key, loss_scale)
        grad_fn = jax.value_and_grad(self._objective, has_aux=True)
        (_, (loss, aux, summaries)), grads = grad_fn(params, batch, key, loss_scale)
        return LocalGradients(grads=grads, loss=loss, aux=aux, summaries=summaries)

    def _microbatches(self, batch: Any) -> Tuple[int, Any]:
        count = self._microbatch_count(batch)
        return count, jax.tree_util.tree_map(
            lambda x: x.reshape((count, self.microbatch_size) + x.shape[1:]), batch)

    def forward_loss(self, params: Any, batch: Any, key: Optional[jax.Array],
                     *, is_training: bool) -> Tuple[jax.Array, Dict[str, jax.Array]]:
        """``(loss, aux)`` of the pipelined model under GPipe / circular: the loss is this
        device's partial sum over the pipe axis (summed over ``pipe`` it is the mean over the
        data shard)."""
        return self._forward(params, batch, key, is_training=is_training)[:2]

    def _forward(self, params, batch, key, *, is_training):
        """``(loss, aux, summaries)``; the summaries too are partial sums over ``pipe``."""
        parts = self.parts
        cfg_stages = self.mesh_shape[self.pipe_axis]
        local = jax.tree_util.tree_leaves(batch)[0].shape[0]
        count, microbatches = self._microbatches(batch)
        stage_index = collectives.axis_index(self.pipe_axis)
        top, stage_params = parts.split(params)
        parts.prepare(params, jax.tree_util.tree_map(lambda v: v[0], microbatches))
        embedded = jax.vmap(lambda mb, m: parts.embed(top, mb, m, key, is_training))(
            microbatches, jnp.arange(count))

        def stage_fn(p, x, m, model_stage):
            return parts.stage(p, x, m, model_stage, key, is_training, microbatches)

        if self.virtual_stages > 1:  # Leaves [v, 1, L/(vS), ...]: this device's v slices.
            slices = jax.tree_util.tree_map(lambda x: x[:, 0], stage_params)
            decoded, summaries = pipeline.circular(
                stage_fn, slices, embedded, axis=self.pipe_axis,
                virtual_stages=self.virtual_stages, remat_ticks=self.remat_ticks,
                with_summaries=True)
        else:
            decoded, summaries = pipeline.gpipe(stage_fn, stage_params, embedded,
                                                axis=self.pipe_axis, remat_ticks=self.remat_ticks,
                                                with_summaries=True)
        head_key = _part_key(key, 0, 2)  # The head has no randomness.
        if count % cfg_stages == 0:
            # Hand each pipe rank M/S of the last stage's outputs (a reduce-scatter: the other
            # stages hold zeros), so the head and the loss run once per microbatch, spread over
            # the ranks instead of on the last stage alone. Its transpose (all-gather) returns
            # the gradients to the last stage.
            share = count // cfg_stages
            mine = collectives.reduce_scatter(decoded, self.pipe_axis, scatter_dimension=0)
            rows = jax.tree_util.tree_map(
                lambda x: jax.lax.dynamic_slice_in_dim(x, stage_index * share, share).reshape(
                    (share * self.microbatch_size,) + x.shape[2:]), microbatches)
            _, aux, head_summaries = parts.head_loss(
                top, mine.reshape((share * self.microbatch_size,) + mine.shape[2:]), rows,
                head_key, is_training)
            # Token-weighted: this share's loss sum over the whole shard's weight (padding rows
            # weigh 0), so the partial sums over pipe add up to the one-device loss exactly.
            # Summaries: each rank's share is 1/S of the microbatches.
            summaries.update({k: v / cfg_stages for k, v in head_summaries.items()})
            return (aux["loss_sum"].astype(jnp.float32) / parts.total_weight(batch), aux,
                    summaries)
        decoded = decoded.reshape((local,) + decoded.shape[2:])
        loss, aux, head_summaries = parts.head_loss(top, decoded, batch, head_key, is_training)
        last = stage_index == cfg_stages - 1
        loss = jnp.where(last, loss.astype(jnp.float32), 0.0)
        aux = {k: jnp.where(last, v, jnp.zeros_like(v)) for k, v in aux.items()}
        summaries.update({k: jnp.where(last, v, 0.0) for k, v in head_summaries.items()})
        return loss, aux, summaries

    def _microbatch_count(self, batch: Any) -> int:
        local = jax.tree_util.tree_leaves(batch)[0].shape[0]
        if local % self.microbatch_size:
            raise errors.PlanError(
                f"microbatches of {self.microbatch_size} do not divide the per-data-shard batch "
                f"of {local}", path="plan.pipeline_parallel.microbatch_size",
                suggestion="choose a microbatch_size that divides the per-shard batch")
        return local // self.microbatch_size

    def _one_f_one_b(self, params, batch, key, loss_scale) -> LocalGradients:
        """Gradients by the static 1F1B table (parallel/one_f_one_b.py), explicit vjp per stage."""
        parts = self.parts
        stages = self.mesh_shape[self.pipe_axis]
        count, microbatches = self._microbatches(batch)
        table = one_f_one_b.build_schedule(stages, count)
        axes = tuple(self.mesh_shape)
        stage_index = collectives.axis_index(self.pipe_axis)
        top, stage_params = parts.split(params)
        precision = self.precision
        compute_batches = precision.cast_for_compute(microbatches)
        parts.prepare(precision.cast_for_compute(params),
                      jax.tree_util.tree_map(lambda v: v[0], compute_batches))
        total_weight = parts.total_weight(batch)

        def row(m):
            return jax.tree_util.tree_map(lambda v: v[m], compute_batches)

        def embed_fn(top_params, m):
            return parts.embed(precision.cast_for_compute(top_params), row(m), m, key, True)

        def stage_fn(sp, x, m):
            return parts.stage(precision.cast_for_compute(sp), x, m, stage_index, key, True,
                               compute_batches)

        def head_fn(sp, top_params, x, m):
            decoded, stage_summaries = stage_fn(sp, x, m)
            _, aux, head_summaries = parts.head_loss(precision.cast_for_compute(top_params),
                                                     decoded, row(m), _part_key(key, m, 2), True)
            # Token-weighted over the shard (see forward_loss), not a mean of microbatch means.
            loss = aux["loss_sum"].astype(jnp.float32) / total_weight
            objective = loss / self.loss_relation.copies_seen_by_autodiff(loss, self.mesh_shape)
            if loss_scale is not None:
                objective = objective * loss_scale
            # Summaries as partial sums over pipe of the mean over microbatches (and stages).
            summaries = {**{k: v / (count * stages) for k, v in stage_summaries.items()},
                         **{k: v / count for k, v in head_summaries.items()}}
            return objective, (loss, aux, summaries)

        activation = jax.eval_shape(lambda: embed_fn(top, 0))
        varying = lambda x: collectives.cast_varying(x, axes)  # noqa: E731
        zeros_act = varying(jnp.zeros(activation.shape, activation.dtype))
        _, aux_shape, summary_shape = jax.eval_shape(
            lambda: head_fn(stage_params, top, zeros_act, 0)[1])
        init = {
            "acts": varying(jnp.zeros((stages,) + activation.shape, activation.dtype)),
            "grads_in": varying(jnp.zeros((stages,) + activation.shape, activation.dtype)),
            "g_stage": jax.tree_util.tree_map(jnp.zeros_like, stage_params),
            "g_top": jax.tree_util.tree_map(jnp.zeros_like, top),
            "loss": varying(jnp.zeros((), jnp.float32)),
            "aux": jax.tree_util.tree_map(lambda a: varying(jnp.zeros(a.shape, a.dtype)),
                                          aux_shape),
            "summaries": {k: varying(jnp.zeros(a.shape, jnp.float32))
                          for k, a in summary_shape.items()},
        }
        add = lambda a, b: jax.tree_util.tree_map(jnp.add, a, b)  # noqa: E731

        def with_stage_summaries(carry, summaries):
            """A forward tick's stage summaries: partial sums over pipe of the mean over
            microbatches and stages (the last stage's come with its head, in backward)."""
            scaled = {k: v / (count * stages) for k, v in summaries.items()}
            return dict(carry, summaries={k: v + scaled.get(k, 0.0)
                                          for k, v in carry["summaries"].items()})

        def idle(carry, m):
            del m
            return carry, zeros_act, zeros_act

        def forward_first(carry, m):
            x = embed_fn(top, m)
            carry = dict(carry, acts=carry["acts"].at[m % stages].set(x))
            y, summaries = stage_fn(stage_params, x, m)
            return with_stage_summaries(carry, summaries), y, zeros_act

        def forward_middle(carry, m):
            y, summaries = stage_fn(stage_params, carry["acts"][m % stages], m)
            return with_stage_summaries(carry, summaries), y, zeros_act

        def forward_last(carry, m):  # The input is kept; the backward runs the stage and head.
            del m
            return carry, zeros_act, zeros_act

        def backward_last(carry, m):
            x = carry["acts"][m % stages]
            objective, vjp, (loss, aux, summaries) = jax.vjp(
                lambda sp, tp, xx: head_fn(sp, tp, xx, m), stage_params, top, x, has_aux=True)
            d_stage, d_top, dx = vjp(jnp.ones_like(objective))
            carry = dict(carry, g_stage=add(carry["g_stage"], d_stage),
                         g_top=add(carry["g_top"], d_top), loss=carry["loss"] + loss,
                         aux=add(carry["aux"], aux), summaries=add(carry["summaries"], summaries))
            return carry, zeros_act, dx

        def backward_middle(carry, m, first=False):
            x = carry["acts"][m % stages]
            _, vjp = jax.vjp(lambda sp, xx: stage_fn(sp, xx, m)[0], stage_params, x)
            d_stage, dx = vjp(carry["grads_in"][m % stages])
            carry = dict(carry, g_stage=add(carry["g_stage"], d_stage))
            if first:
                _, embed_vjp = jax.vjp(lambda tp: embed_fn(tp, m), top)
                carry = dict(carry, g_top=add(carry["g_top"], embed_vjp(dx)[0]))
                return carry, zeros_act, zeros_act
            return carry, zeros_act, dx

        def backward_first(carry, m):
            return backward_middle(carry, m, first=True)

        branches = [idle, forward_first, forward_middle, forward_last, backward_first,
                    backward_middle, backward_last]
        position = np.where(np.arange(stages) == 0, 0,
                            np.where(np.arange(stages) == stages - 1, 2, 1))
        code = np.where(table.kind == one_f_one_b.IDLE, 0,
                        np.where(table.kind == one_f_one_b.FORWARD, 1 + position,
                                 4 + position)).astype(np.int32)
        codes = jnp.asarray(code)
        mbs = jnp.asarray(table.microbatch)
        forward_arrival = jnp.asarray(table.forward_arrival)
        backward_arrival = jnp.asarray(table.backward_arrival)
        ahead = [(i, i + 1) for i in range(stages - 1)]
        behind = [(i + 1, i) for i in range(stages - 1)]

        def receive(buffer, value, microbatch):
            slot = jnp.maximum(microbatch, 0) % stages
            kept = jax.lax.dynamic_index_in_dim(buffer, slot, keepdims=False)
            return jax.lax.dynamic_update_index_in_dim(
                buffer, jnp.where(microbatch >= 0, value, kept), slot, 0)

        def tick(carry, t):
            m = mbs[t, stage_index]
            carry, forward_out, backward_out = jax.lax.switch(codes[t, stage_index], branches,
                                                              carry, m)
            from_before = jax.lax.ppermute(forward_out, self.pipe_axis, ahead)
            from_after = jax.lax.ppermute(backward_out, self.pipe_axis, behind)
            carry = dict(carry,
                         acts=receive(carry["acts"], from_before,
                                      forward_arrival[t, stage_index]),
                         grads_in=receive(carry["grads_in"], from_after,
                                          backward_arrival[t, stage_index]))
            return carry, None

        final, _ = jax.lax.scan(tick, init, jnp.arange(table.num_ticks))
        grads = parts.join(final["g_top"], final["g_stage"])
        grads = {k: grads[k] for k in params}  # The params' key order.
        return LocalGradients(grads=grads, loss=final["loss"], aux=final["aux"],
                              summaries=final["summaries"])

    def _objective(self, params, batch, key, loss_scale):
        compute_params = self.precision.cast_for_compute(params)
        inputs = self.precision.cast_for_compute(batch)
        loss, aux, summaries = self._forward(compute_params, inputs, key, is_training=True)
        objective = loss / self.loss_relation.copies_seen_by_autodiff(loss, self.mesh_shape)
        if loss_scale is not None:
            objective = objective * loss_scale
        return objective, (loss, aux, summaries)



def _token_weight(batch: Dict[str, jax.Array]) -> jax.Array:
    """The weight of a data shard's batch: its token count, or the sum of its ``weights``
    (per token, or per example counting every token of it) -- what GPT's loss divides by."""
    targets = batch["target_ids"]
    weights = batch.get("weights")
    if weights is None:
        return jnp.float32(targets.size)
    weights = weights.astype(jnp.float32)
    padded = weights.reshape(weights.shape + (1,) * (targets.ndim - weights.ndim))
    weights = jnp.broadcast_to(padded, targets.shape)
    return jnp.maximum(jnp.sum(weights), 1.0)


def _part_key(key: Optional[jax.Array], microbatch, part: int) -> Optional[jax.Array]:
    """The dropout key of one part (0 embedding, 1 stages, 2 head) of one microbatch: the same
    whatever the schedule, so every schedule drops out the same units."""
    if key is None:
        return None
    return jax.random.fold_in(jax.random.fold_in(key, microbatch), part)

