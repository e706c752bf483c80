"""The gradient computer: local gradients, loss, aux and summaries of one step, in local view.

First of the train step's three seams (DESIGN section 7): a computer turns params and a batch into
*local* gradients -- nothing reduced over the data axis yet -- plus the loss, the model's aux
counts, the summaries its layers wrote with ``add_summary`` and the new values of their non-trained
params (``add_state_update``). The reducer then reduces them once; the learner applies them.

``ModelGradients`` is the plain computer (one forward/backward) and, with ``accumulate_steps > 1``,
the microbatched one: a ``lax.scan`` over microbatches that sums gradients locally, so no
collective over the data axis sits inside the loop.

Each computer *declares* how its loss relates to the one-device loss on every mesh axis
(``LossRelation``): over the data axis each shard's loss is a mean over its own rows (the reducer
averages); over the TP axis every rank holds a copy. Differentiating a copy that jax types as
*varying* counts it once per rank, so its objective is divided by the number of copies -- the
declaration says which axes hold copies, the type says whether autodiff will see them as one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from titanax.modules import functional
from titanax.modules.context import flat_summaries
from titanax.modules.base_layer import BaseLayer
from titanax.parallel import collectives
from titanax.train import state_updates
from titanax.train.param_gathering import ParamGathering
from titanax.train.precision import Precision


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
                  loss_scale: Optional[jax.Array] = None) -> jax.Array:
        """What a computer differentiates: the loss with its copies counted once (see the
        module docstring), times the loss scale (float16 loss scaling) when there is one."""
        objective = loss / self.copies_seen_by_autodiff(loss, mesh_shape)
        return objective if loss_scale is None else objective * loss_scale


@dataclasses.dataclass
class LocalGradients:
    """What a gradient computer returns (all in local view, unreduced)."""

    grads: Any
    # Mean loss over this device's rows (float32).
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


class ModelGradients:
    """Gradients of ``model.forward(batch) -> (loss, aux)``, with optional microbatches."""

    def __init__(self, *, model: BaseLayer, precision: Precision, mesh_shape: Mapping[str, int],
                 batch_axes: Sequence[str] = (), accumulate_steps: int = 1,
                 gathering: Optional[ParamGathering] = None):
        self.model = model
        self.gathering = gathering
        self.precision = precision
        self.mesh_shape = dict(mesh_shape)
        # The axes the batch is split over (data; under HSDP data and the FSDP axis).
        self.batch_axes = tuple(batch_axes)
        self.accumulate_steps = accumulate_steps
        self.loss_relation = LossRelation(
            mean_over=self.batch_axes,
            copy_over=tuple(a for a in self.mesh_shape if a not in self.batch_axes))

    @property
    def axes(self) -> Tuple[str, ...]:
        return tuple(self.mesh_shape)

    def eval_loss(self, params: Any, batch: Any) -> Tuple[jax.Array, Dict[str, jax.Array]]:
        """``(loss, aux)`` of a forward pass in evaluation mode, on this device's rows."""
        inputs = self.precision.cast_for_compute(batch)
        (loss, aux), _ = functional(self.model, None, self.precision.cast_for_compute(params),
                                    (inputs,), is_training=False)
        return loss.astype(jnp.float32), aux

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
        grad_fn = jax.value_and_grad(functools.partial(self._objective, stored=stored),
                                     has_aux=True)
        count = self.accumulate_steps
        if count == 1:
            (_, (loss, aux, summaries, updates)), grads = grad_fn(params, batch, key, loss_scale)
            return LocalGradients(grads=grads, loss=loss, aux=aux, summaries=summaries,
                                  state_updates=updates)
        microbatches = _split_microbatches(batch, count)

        def accumulate(carry, inputs):
            microbatch, index = inputs
            (_, outputs), grads_i = grad_fn(params, microbatch, jax.random.fold_in(key, index),
                                            loss_scale)
            return jax.tree_util.tree_map(jnp.add, carry, (grads_i,) + outputs), None

        first = jax.tree_util.tree_map(lambda x: x[0], microbatches)
        shapes = jax.eval_shape(lambda: grad_fn(params, first, key, loss_scale)[0][1])
        zeros = jax.tree_util.tree_map(lambda s: self._varying(jnp.zeros(s.shape, s.dtype)),
                                       shapes)
        init = (jax.tree_util.tree_map(jnp.zeros_like, params),) + zeros
        (grads, loss, aux, summaries, updates), _ = jax.lax.scan(
            accumulate, init, (microbatches, jnp.arange(count)))
        average = lambda tree: jax.tree_util.tree_map(lambda x: x / count, tree)  # noqa: E731
        return LocalGradients(grads=average(grads), loss=loss / count, aux=aux,
                              summaries=average(summaries), state_updates=average(updates))

    def _varying(self, value: jax.Array) -> jax.Array:
        """A scan carry the loop body makes varying must start varying (outside shard_map,
        with no mesh axes, there is nothing to cast)."""
        return collectives.cast_varying(value, self.axes) if self.axes else value

    def _objective(self, params, batch, key, loss_scale, *, stored):
        compute_params = self.precision.cast_for_compute(params)
        inputs = self.precision.cast_for_compute(batch)
        (loss, aux), collection = functional(self.model, key, compute_params, (inputs,),
                                             is_training=True)
        loss = loss.astype(jnp.float32)
        objective = self.loss_relation.objective(loss, self.mesh_shape, loss_scale)
        updates = state_updates.collect(collection.state_updates, stored,
                                        where=f"{type(self.model).__qualname__}.forward")
        return objective, (loss, aux, flat_summaries(collection.summaries),
                           jax.lax.stop_gradient(updates))



def _split_microbatches(batch: Any, count: int) -> Any:
    """``[rows, ...]`` -> ``[count, rows / count, ...]`` (``Plan.check_batch_size`` checked that
    every batch shard splits into ``accumulate_steps`` microbatches before compiling)."""
    return jax.tree_util.tree_map(
        lambda x: x.reshape((count, x.shape[0] // count) + x.shape[1:]), batch)
