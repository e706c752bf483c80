"""The model train step in local view: gradient computer, gradient reducer, learner update.

This function runs inside ``shard_map`` over every mesh axis (the engine wraps it), so every
collective in it is written here, in the reducer or in a layer:

1. Params are cast to *varying* over every axis they are replicated on. Otherwise ``jax.grad``
   would all-reduce the gradient of each replicated param on every call -- once per microbatch.
2. The gradient computer (``gradients.py``) returns local gradients, the loss, aux counts and the
   layers' summaries; with ``accumulate_steps`` a ``lax.scan`` over microbatches sums them
   locally, nothing reduced inside the loop except what layers need (TP psums). When the batch
   is split, each shard's loss is weighted by its trained tokens (gradients.py).
3. The gradient reducer (``reducer.py``, planned once from the param specs) reduces every
   gradient once, after the loop, over exactly the axes its param is replicated on, in one
   data-axis all-reduce that also carries the metrics (with ZeRO-2 / FSDP: a reduce-scatter
   into the state's layout for the sharded ones) and one all-reduce per other set of axes.
4. The state-sharding strategy (``state_sharding.py``) runs the Learner's update (clipping by the
   global norm, the optax update) on its part of the optimizer state; the state updates the
   layers wrote (``state_updates.py``, averaged like the loss) replace their params' values; then
   loss scaling (float16) and NaN/Inf handling decide whether it is kept.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from titanax import errors
from titanax.modules.base_layer import BaseLayer
from titanax.modules.context import expand_vector_metrics
from titanax.parallel import collectives, sharding
from titanax.train import learner as learner_lib
from titanax.train import state_updates
from titanax.train.gradients import ModelGradients
from titanax.train.metric_reduction import reduce_metrics
from titanax.train.objective import OBJECTIVE_METRICS, ModelLoss, Objective
from titanax.train.param_gathering import ParamGathering
from titanax.train.pipelined_gradients import PipelinedGradients
from titanax.train.state_sharding import StateSharding
from titanax.train.precision import Precision
from titanax.train.reducer import GradientReducer, Reduced
from titanax.train.train_state import TrainState
from titanax.train.user_step import check_scalar_metrics
from titanax.utils.dtypes import at_least_float32


@dataclasses.dataclass
class StepSetup:
    """Everything the local step needs that is fixed at compile time."""

    model: BaseLayer
    precision: Precision
    adapter: learner_lib.OptimizerAdapter
    learner: learner_lib.Learner
    # Mesh axis names and sizes.
    mesh_shape: Dict[str, int]
    # The data-parallel axis (None: no DP): the one all-reduce of the step crosses it.
    data_axis: Optional[str]
    # The axes the batch is split over: (data,), or (data, fsdp) under HSDP; () without DP.
    batch_axes: Tuple[str, ...]
    accumulate_steps: int
    # How params and optimizer state are laid out and updated (state_sharding.py).
    state_sharding: StateSharding
    # "stop": report non-finite losses (the engine raises); "skip": also leave the state as is.
    nan_policy: str = "stop"
    # Reduce metrics over the data axis (DP.sync_metrics); False: report data shard 0's values.
    sync_metrics: bool = True
    # The pipeline (PP config) when the plan has one.
    pipeline: Optional[Any] = None
    # Batch axes the data all-reduce crosses too (context and expert parallelism's:
    # reducer.py).
    fold_axes: Tuple[str, ...] = ()
    # Batch axes whose layers sum the gradients of the params split over them (the expert
    # axis: reducer.py's layer_summed_axes).
    layer_summed_axes: Tuple[str, ...] = ()
    # What the model is trained toward (train/objective.py).
    objective: Objective = dataclasses.field(default_factory=ModelLoss)

    @property
    def axes(self) -> Tuple[str, ...]:
        return tuple(self.mesh_shape)

    @property
    def batch_axis(self) -> sharding.AxisEntry:
        """``batch_axes`` as one collective / spec argument (None without DP)."""
        return sharding.axis_entry(self.batch_axes)

    @functools.cached_property
    def gradients(self):
        """The gradient computer: pipelined when the plan has a pipeline, else plain or
        microbatched."""
        if self.pipeline is not None:
            if not self.objective.staged_by_pipelines:
                raise errors.PlanError(
                    f"the {type(self.objective).__name__} objective computes its loss from whole "
                    "rows of the model's outputs, which the pipeline schedules do not stage",
                    path="plan.pipeline_parallel",
                    suggestion="train it without pipeline_parallel (DP, TP, FSDP)")
            return PipelinedGradients(
                model=self.model, precision=self.precision, mesh_shape=self.mesh_shape,
                batch_axes=self.batch_axes, pipeline=self.pipeline.instantiate(),
                gathering=self.gathering, trainable=self.state_sharding.trainable)
        return ModelGradients(model=self.model, precision=self.precision,
                              mesh_shape=self.mesh_shape, batch_axes=self.batch_axes,
                              accumulate_steps=self.accumulate_steps, gathering=self.gathering,
                trainable=self.state_sharding.trainable, objective=self.objective)

    @functools.cached_property
    def gathering(self) -> Optional[ParamGathering]:
        """How the gradient computer sees the params whole (None: they are stored whole)."""
        return self.state_sharding.param_gathering()

    @functools.cached_property
    def reducer(self) -> GradientReducer:
        strategy = self.state_sharding
        return GradientReducer.plan(param_specs=strategy.grad_specs, mesh_shape=self.mesh_shape,
                                    data_axis=self.data_axis,
                                    loss_relation=self.gradients.loss_relation,
                                    scatter_dims=strategy.scatter_dims,
                                    shard_axis=strategy.shard_axis,
                                    # Every param's (state updates are numbered among all
                                    # of them, frozen ones included).
                                    param_layout=strategy.param_specs,
                                    fold_axes=self.fold_axes,
                                    layer_summed=self.layer_summed_axes,
                                    gather_summed=strategy.gather_summed_axes)


def local_train_step(setup: StepSetup, state: TrainState, batch: Any
                     ) -> Tuple[TrainState, Dict[str, jax.Array]]:
    """One optimizer step in local view: gradient computer, reducer, learner update."""
    varying_params = collectives.cast_varying(state.params, setup.axes)
    step_key = jax.random.fold_in(state.rngs["dropout"], state.step)
    if setup.batch_axes:
        # Different dropout masks per data shard; the same on every model rank of a shard.
        step_key = jax.random.fold_in(step_key, collectives.axis_index(setup.batch_axis))
    scale = state.loss_scale["scale"] if state.loss_scale is not None else None
    local = setup.gradients(varying_params, batch, step_key, loss_scale=scale)
    grads, loss, aux = local.grads, local.loss, local.aux
    if scale is not None:
        # Unscale in float32, keep each gradient's dtype (the optimizer state's dtype follows it).
        grads = jax.tree_util.tree_map(
            lambda g: (at_least_float32(g) / scale).astype(g.dtype), grads)
    check_scalar_metrics({"loss": loss, **{f"aux/{k}": v for k, v in aux.items()}},
                         where=f"{type(setup.model).__qualname__}.forward")
    # The scopes name the collectives of the reduction and the update in --explain.
    with jax.named_scope("gradient_reduction"):
        reduced = setup.reducer.reduce(grads, mean_metrics={"loss": loss, **local.summaries},
                                       sum_metrics={f"aux/{k}": v for k, v in aux.items()},
                                       weight=local.weight, sync_data=setup.sync_metrics,
                                       state_updates=local.state_updates)
    with jax.named_scope("optimizer_update"):
        new_state, update_stats = _apply_update(setup, state, reduced)
    metrics = _metrics(setup, state, reduced.metrics, update_stats)
    return new_state, metrics


def _apply_update(setup: StepSetup, state: TrainState, reduced: Reduced):
    loss = reduced.metrics["loss"]
    new_params, new_opt_state, norm = setup.state_sharding.update(
        learner=setup.learner, adapter=setup.adapter, params=state.params,
        opt_state=state.opt_state, grads=reduced.grads, norm_squared=reduced.norm_squared)
    if reduced.state_updates:
        # Non-trained state: the layers' new values replace whatever the optimizer made of it.
        new_params = state_updates.write(new_params, reduced.state_updates)
    # Decisions every device must take identically: reduce the evidence over all axes.
    grads_finite = jnp.isfinite(norm)
    loss_finite = _all_devices(jnp.isfinite(loss))
    apply = grads_finite
    if setup.nan_policy == "skip":
        apply = apply & loss_finite
    keep = lambda new, old: jax.tree_util.tree_map(  # noqa: E731
        lambda n, o: jnp.where(apply, n, o), new, old)
    guarded = state.loss_scale is not None or setup.nan_policy == "skip"
    new_params = keep(new_params, state.params) if guarded else new_params
    new_opt_state = keep(new_opt_state, state.opt_state) if guarded else new_opt_state
    loss_scale = state.loss_scale
    if loss_scale is not None:
        loss_scale = setup.precision.next_scale_state(loss_scale, grads_finite)
    new_state = state.replace(params=new_params, opt_state=new_opt_state, step=state.step + 1,
                              loss_scale=loss_scale)
    return new_state, {"grad_norm": norm, "update_applied": apply.astype(jnp.float32),
                       "loss_finite": loss_finite.astype(jnp.float32)}


def objective_metrics_by_name(metrics: Dict[str, jax.Array]) -> Dict[str, jax.Array]:
    """The objective's metrics (summaries ``metrics/<name>`` of the model's root, e.g.
    ``rewards/chosen``) under their own names, as TRL reports them."""
    prefix = f"summaries/{OBJECTIVE_METRICS}/"
    return {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in metrics.items()}


def _all_devices(flag: jax.Array) -> jax.Array:
    """True on every device iff ``flag`` is true on every device (an invariant result)."""
    axes = tuple(sorted(collectives.varying_axes(flag)))
    if not axes:
        return flag
    return collectives.psum((~flag).astype(jnp.int32), axes) == 0


def _metrics(setup: StepSetup, state: TrainState, reduced_metrics: Dict[str, jax.Array],
             stats) -> Dict[str, jax.Array]:
    metrics = objective_metrics_by_name(expand_vector_metrics(reduced_metrics))
    if setup.batch_axes and not setup.sync_metrics:
        metrics = {k: v[None] for k, v in metrics.items()}
        stats = {k: v[None] for k, v in stats.items()}
    metrics.update(stats)
    extra = {"learning_rate": setup.learner.learning_rate(state.step)}
    if state.loss_scale is not None:
        extra["loss_scale"] = state.loss_scale["scale"]
    if setup.batch_axes and not setup.sync_metrics:
        extra = {k: collectives.cast_varying(v, setup.batch_axes)[None] for k, v in extra.items()}
    metrics.update(extra)
    return metrics


class ModelStep:
    """The engine's own step for its configured model: one implementation of the local-step
    protocol (``train(state, batch)``, ``eval(params, batch)``, ``metric_spec``) that the
    engine runs inside its ``shard_map``; ``user_step.UserStep`` is the other."""

    def __init__(self, setup: StepSetup):
        self.setup = setup

    @property
    def metric_spec(self):
        """How the metrics leave shard_map: replicated, or per data shard without sync."""
        setup = self.setup
        if setup.batch_axes and not setup.sync_metrics:
            return PartitionSpec(setup.batch_axis)
        return PartitionSpec()

    def train(self, state: TrainState, batch: Any) -> Tuple[TrainState, Dict[str, jax.Array]]:
        return local_train_step(self.setup, state, batch)

    def eval(self, params: Any, batch: Any) -> Dict[str, jax.Array]:
        """Forward only (is_training=False): the loss averaged and the aux counts summed over
        the batch axes."""
        setup = self.setup
        gathering = setup.gathering
        if gathering is not None:  # FSDP: layer by layer where the step does so, else at once.
            params = gathering.for_use(params)
        loss, aux = setup.gradients.eval_loss(params, batch)
        aux = {f"aux/{k}": v for k, v in aux.items()}
        return expand_vector_metrics(reduce_metrics(
            {"loss": loss, **aux}, batch_axes=setup.batch_axes, axes=setup.axes, summed=aux))
