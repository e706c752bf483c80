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

from titanax import errors
from titanax.modules import functional, gather_on_use
from titanax.modules.context import flat_summaries
from titanax.modules.base_layer import BaseLayer
from titanax.parallel import collectives
from titanax.train import state_updates
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


@dataclasses.dataclass(frozen=True)
class ParamGathering:
    """How a computer sees FSDP's sharded params whole (state_sharding.FullySharded).

    ``per_microbatch``: the params are wrapped in ``GatherOnUse`` and each layer gathers its own
    where it runs; the transpose of each gather reduce-scatters (sums) that layer's gradient, so
    the unwrapped gradients are divided by the axis size (a mean, as over the data axis).
    Otherwise (``per_step``) everything is gathered once, before the microbatch loop, and the
    whole gradients are left to the reducer's reduce-scatter.
    """

    axis: str
    axis_size: int
    # Per param, the dimension split over ``axis`` (None: stored whole).
    dims: Any
    per_microbatch: bool

    def for_use(self, params: Any) -> Any:
        """The params as the model sees them: wrapped (``per_microbatch``) or all gathered."""
        return self.wrap(params) if self.per_microbatch else self.gather_all(params)

    def gather_all(self, params: Any) -> Any:
        return jax.tree_util.tree_map(
            lambda p, d: p if d is None else collectives.all_gather(p, self.axis, axis_index=d),
            params, self.dims)

    def wrap(self, params: Any) -> Any:
        return gather_on_use.wrap(params, self.dims, axis=self.axis)

    def unwrap_gradients(self, grads: Any) -> Any:
        return jax.tree_util.tree_map(
            lambda g: g.shard / self.axis_size if gather_on_use.is_gather_on_use(g) else g,
            grads, is_leaf=gather_on_use.is_gather_on_use)


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
        objective = loss / self.loss_relation.copies_seen_by_autodiff(loss, self.mesh_shape)
        if loss_scale is not None:
            objective = objective * loss_scale
        updates = state_updates.collect(collection.state_updates, stored,
                                        where=f"{type(self.model).__qualname__}.forward")
        return objective, (loss, aux, flat_summaries(collection.summaries),
                           jax.lax.stop_gradient(updates))



def _split_microbatches(batch: Any, count: int) -> Any:
    def split(x):
        if x.shape[0] % count:
            raise errors.PlanError(
                f"the per-device batch of {x.shape[0]} does not split into {count} microbatches",
                path="plan.data_parallel.accumulate_steps",
                suggestion="make the global batch a multiple of (batch shards: the data size, x "
                           "the fsdp size under HSDP) x accumulate_steps")
        return x.reshape((count, x.shape[0] // count) + x.shape[1:])
    return jax.tree_util.tree_map(split, batch)
