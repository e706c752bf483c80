"""The gradient computer: local gradients, loss, aux and summaries of one step, in local view.

First of the train step's three seams (DESIGN section 7): a computer turns params and a batch into
*local* gradients -- nothing reduced over the data axis yet -- plus the loss, the model's aux
counts, the summaries its layers wrote with ``add_summary`` and the new values of their non-trained
params (``add_state_update``). The reducer then reduces them once; the learner applies them.

``ModelGradients`` is the plain computer (one forward/backward) and, with ``accumulate_steps > 1``,
the microbatched one: a ``lax.scan`` over microbatches that sums gradients locally, so no
collective over the data axis sits inside the loop.

Each computer *declares* how its loss relates to the one-device loss on every mesh axis
(``LossRelation``): over the data axis each shard's loss is a mean over its own trained tokens;
over the TP axis every rank holds a copy. Differentiating a copy that jax types as *varying*
counts it once per rank, so its objective is divided by the number of copies -- the declaration
says which axes hold copies, the type says whether autodiff will see them as one.

**Token-weighted.** The step's loss is the mean over every trained token of the batch, however
unevenly the shards and microbatches hold them (an SFT batch's completions differ in length; a
mean of per-shard means would weigh a short shard's tokens more). So when the batch is split
(data shards, microbatches) and the model reports its count (``loss_count``), each device
differentiates its mean loss times its *weight* -- its trained tokens over ``loss_capacity``, a
constant every shard shares -- and the reducer divides the reduced gradients by the mean weight,
which rides in the collectives already there. The weight enters before the backward, not after,
because some gradients are summed over the batch axes inside it (FSDP's per-layer gathers
transpose to reduce-scatters); the constant keeps the weighted gradients the size of a mean's
(float16's range).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from titanax.modules.context import flat_summaries
from titanax.modules.base_layer import BaseLayer
from titanax.parallel import collectives
from titanax.train import state_updates
from titanax.train.objective import ModelLoss, Objective
from titanax.train.param_gathering import ParamGathering
from titanax.train.precision import Precision
from titanax.train.trainable import Trainable
from titanax.utils.dtypes import at_least_float32


@dataclasses.dataclass(frozen=True)
class LossRelation:
    """How a device's loss relates to the one-device loss, per mesh axis."""

    # Each device's loss is the mean over its own share of the batch: average over these.
    mean_over: Tuple[str, ...] = ()
    # Every device holds the same value: nothing to reduce, but autodiff must count it once.
    copy_over: Tuple[str, ...] = ()
    # Each device holds a part of a sum (a pipeline stage's microbatches): sum over these.
    sum_over: Tuple[str, ...] = ()

    def copies_seen_by_autodiff(self, loss: jax.Array, mesh_shape: Mapping[str, int]) -> int:
        """The declared copies that jax types as varying (each would be differentiated): the
        objective is divided by this so the copies count once."""
        varying = collectives.varying_axes(loss)
        return math.prod(mesh_shape[a] for a in self.copy_over if a in varying)

    def objective(self, loss: jax.Array, mesh_shape: Mapping[str, int],
                  loss_scale: Optional[jax.Array] = None, *,
                  weight: Optional[jax.Array] = None) -> jax.Array:
        """What a computer differentiates: the loss with its copies counted once (see the
        module docstring), times its weight when the shards are weighted, times the loss
        scale (float16 loss scaling) when there is one."""
        objective = loss / self.copies_seen_by_autodiff(loss, mesh_shape)
        if weight is not None:
            objective = objective * jax.lax.stop_gradient(weight)
        return objective if loss_scale is None else objective * loss_scale


@dataclasses.dataclass
class LocalGradients:
    """What a gradient computer returns (all in local view, unreduced)."""

    # The gradients of ``loss`` -- times ``weight`` when there is one.
    grads: Any
    # Mean loss over this device's trained tokens (or examples, or rows; float32).
    loss: jax.Array
    # The model's aux counts (e.g. loss_sum, num_tokens), summed over microbatches.
    aux: Dict[str, jax.Array]
    # Scalar summaries the layers wrote, "summaries/<module path>/<name>", averaged over
    # microbatches (per-layer summaries of a stacked Repeat averaged over its layers).
    summaries: Dict[str, jax.Array]
    # New values the layers wrote for their non-trained params (``add_state_update``),
    # ``{flattened param index: value}`` in local view, averaged over microbatches
    # (state_updates.py).
    state_updates: Dict[int, jax.Array] = dataclasses.field(default_factory=dict)
    # This device's trained tokens over ``loss_capacity`` (see the module docstring): the
    # reducer averages the batch shards weighted by it. None: the gradients are the plain
    # mean's, and every shard weighs the same.
    weight: Optional[jax.Array] = None


# The aux counts a model's loss can be a mean over, in the order they are looked for.
LOSS_COUNTS = ("num_tokens", "num_examples")


def loss_count(aux: Mapping[str, jax.Array]) -> Optional[jax.Array]:
    """What a forward's loss is a mean over, as its aux reports it (None: not reported)."""
    for name in LOSS_COUNTS:
        if name in aux:
            return at_least_float32(aux[name])
    return None


def loss_capacity(batch: Any) -> int:
    """What a shard's weight is counted against: the most target tokens it can hold (the
    size of ``target_ids``), else its rows. Only its sameness on every shard matters for the
    result; its size keeps the weighted gradients near a mean's."""
    targets = batch.get("target_ids") if isinstance(batch, Mapping) else None
    if targets is not None:
        return max(1, int(math.prod(targets.shape)))
    return max(1, int(jax.tree_util.tree_leaves(batch)[0].shape[0]))


def weighs_shards(*, batch_shards: int, pieces: int) -> bool:
    """Whether the shards' token counts must weigh their losses: when the batch is split over
    devices or microbatches (else the one mean is already the token mean)."""
    return batch_shards > 1 or pieces > 1


class ModelGradients:
    """Gradients of ``model.forward(batch) -> (loss, aux)``, with optional microbatches."""

    def __init__(self, *, model: BaseLayer, precision: Precision, mesh_shape: Mapping[str, int],
                 batch_axes: Sequence[str] = (), accumulate_steps: int = 1,
                 gathering: Optional[ParamGathering] = None,
                 trainable: Optional[Trainable] = None, objective: Optional[Objective] = None):
        self.model = model
        # What the model is trained toward (train/objective.py): its loss on a device's rows.
        self.objective = objective if objective is not None else ModelLoss()
        self.gathering = gathering
        # The params differentiated (None: all); the frozen ones only run the forward.
        self.trainable = trainable
        self.precision = precision
        self.mesh_shape = dict(mesh_shape)
        # The axes the batch is split over (data; under HSDP data and the FSDP axis).
        self.batch_axes = tuple(batch_axes)
        self.accumulate_steps = accumulate_steps
        self.loss_relation = LossRelation(
            mean_over=self.batch_axes,
            copy_over=tuple(a for a in self.mesh_shape if a not in self.batch_axes))
        self.weighted = weighs_shards(
            batch_shards=math.prod(self.mesh_shape[a] for a in self.batch_axes),
            pieces=accumulate_steps)

    @property
    def axes(self) -> Tuple[str, ...]:
        return tuple(self.mesh_shape)

    def compute_inputs(self, batch: Any) -> Any:
        """The batch in the compute dtype -- but for the fields the objective reads exactly
        (``exact_fields``: an RL rollout's old log-probs and advantages, which bfloat16 would
        round by ~1%)."""
        exact = self.objective.exact_fields
        if not exact or not isinstance(batch, Mapping):
            return self.precision.cast_for_compute(batch)
        cast = self.precision.cast_for_compute({k: v for k, v in batch.items()
                                                if k not in exact})
        return dict(cast, **{k: batch[k] for k in exact if k in batch})

    def eval_loss(self, params: Any, batch: Any) -> Tuple[jax.Array, Dict[str, jax.Array]]:
        """``(loss, aux)`` of a forward pass in evaluation mode, on this device's rows."""
        inputs = self.compute_inputs(batch)
        (loss, aux), _ = self.objective.loss(
            self.model, self.precision.cast_for_compute(params), inputs, key=None,
            is_training=False, batch_axes=self.batch_axes)
        return at_least_float32(loss), aux

    @staticmethod
    def schedule_metrics(local_rows: int) -> Dict[str, float]:
        """Metrics its schedule fixes (a pipeline's bubble): none here."""
        del local_rows
        return {}

    @staticmethod
    def describe(**unused) -> Optional[str]:
        """--explain's part for the schedule: nothing beyond the plan's table here."""
        del unused
        return None

    def __call__(self, params: Any, batch: Any, key: jax.Array, *,
                 loss_scale: Optional[jax.Array] = None) -> LocalGradients:
        """``params`` already cast to varying over every axis (see step.py); ``key`` this
        step's dropout key on this data shard. Under FSDP ``params`` are this device's shards
        and so are the gradients returned (with ``grad_sync="per_step"`` whole, for the
        reducer's reduce-scatter)."""
        stored = jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
        gathering = self.gathering
        if gathering is not None:
            params = gathering.for_use(params)
        local = self._gradients(params, batch, key, loss_scale, stored)
        if gathering is not None and gathering.per_microbatch:
            local.grads = gathering.unwrap_gradients(local.grads)
        return local

    def _gradients(self, params, batch, key, loss_scale, stored) -> LocalGradients:
        # Every microbatch's weight is counted against the whole shard's capacity, so their
        # weights add up to the shard's.
        objective = functools.partial(self._objective, stored=stored,
                                      capacity=loss_capacity(batch))
        trainable = self.trainable
        if trainable is not None and not trainable.everything:
            # Differentiated by the trainable params only: the frozen ones enter as constants.
            whole = params
            objective = functools.partial(
                lambda trained, *args, f: f(trainable.merge(whole, trained), *args), f=objective)
            params = trainable.select(params)
        grad_fn = jax.value_and_grad(objective, has_aux=True)
        count = self.accumulate_steps
        if count == 1:
            (_, (loss, aux, summaries, updates, weight)), grads = grad_fn(params, batch, key,
                                                                          loss_scale)
            return LocalGradients(grads=grads, loss=loss, aux=aux, summaries=summaries,
                                  state_updates=updates, weight=weight)
        microbatches = _split_microbatches(batch, count)

        def accumulate(carry, inputs):
            # Weighted, the summed gradients are those of sum(weight x loss); the loss is
            # summed the same way and divided by the summed weight below.
            microbatch, index = inputs
            (_, (loss_i, aux_i, summaries_i, updates_i, weight_i)), grads_i = grad_fn(
                params, microbatch, jax.random.fold_in(key, index), loss_scale)
            if weight_i is not None:
                loss_i = loss_i * weight_i
            outputs = (grads_i, loss_i, aux_i, summaries_i, updates_i, weight_i)
            return jax.tree_util.tree_map(jnp.add, carry, outputs), None

        first = jax.tree_util.tree_map(lambda x: x[0], microbatches)
        shapes = jax.eval_shape(lambda: grad_fn(params, first, key, loss_scale)[0][1])
        zeros = jax.tree_util.tree_map(lambda s: self._varying(jnp.zeros(s.shape, s.dtype)),
                                       shapes)
        init = (jax.tree_util.tree_map(jnp.zeros_like, params),) + zeros
        (grads, loss, aux, summaries, updates, weight), _ = jax.lax.scan(
            accumulate, init, (microbatches, jnp.arange(count)))
        average = lambda tree: jax.tree_util.tree_map(lambda x: x / count, tree)  # noqa: E731
        if weight is None:
            return LocalGradients(grads=average(grads), loss=loss / count, aux=aux,
                                  summaries=average(summaries), state_updates=average(updates))
        # An all-padding shard has summed zeros: its mean loss is 0, not 0/0.
        return LocalGradients(grads=grads, loss=loss / jnp.where(weight > 0, weight, 1.0),
                              aux=aux, summaries=average(summaries),
                              state_updates=average(updates), weight=weight)

    def _varying(self, value: jax.Array) -> jax.Array:
        """A scan carry the loop body makes varying must start varying (outside shard_map,
        with no mesh axes, there is nothing to cast)."""
        return collectives.cast_varying(value, self.axes) if self.axes else value

    def _objective(self, params, batch, key, loss_scale, *, stored, capacity):
        compute_params = self.precision.cast_for_compute(params)
        (loss, aux), collection = self.objective.loss(
            self.model, compute_params, self.compute_inputs(batch), key=key, is_training=True,
            batch_axes=self.batch_axes)
        loss = at_least_float32(loss)
        count = loss_count(aux) if self.weighted else None
        weight = None if count is None else jax.lax.stop_gradient(count) / capacity
        objective = self.loss_relation.objective(loss, self.mesh_shape, loss_scale,
                                                 weight=weight)
        updates = state_updates.collect(collection.state_updates, stored,
                                        where=f"{type(self.model).__qualname__}.forward",
                                        stored=params)
        return objective, (loss, aux, flat_summaries(collection.summaries),
                           jax.lax.stop_gradient(updates), weight)



def _split_microbatches(batch: Any, count: int) -> Any:
    """``[rows, ...]`` -> ``[count, rows / count, ...]`` (``Plan.check_batch_size`` checked that
    every batch shard splits into ``accumulate_steps`` microbatches before compiling)."""
    return jax.tree_util.tree_map(
        lambda x: x.reshape((count, x.shape[0] // count) + x.shape[1:]), batch)
