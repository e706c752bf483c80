"""The compiled steps: ``jit(shard_map(local step, mesh, in_specs, out_specs))``, from the layout.

The whole step runs inside one ``shard_map`` over every mesh axis with the state donated, so XLA
partitions nothing by itself and the collectives in the compiled step are exactly the ones
written (``Engine.collectives()`` lists them). The local step is the engine's own for its model
(``step.ModelStep``: gradient computer, reducer, state-sharding strategy) or a hand-written
``@step_fn`` (``user_step.UserStep``). Specs come from the layout and the plan's batch axes,
without the mesh axes of size 1 (nothing moves over those; parallel/layout.py).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from titanax import errors
from titanax.decoding.placement import OnMesh
from titanax.parallel import axis_binding
from titanax.modules import converters as converters_lib
from titanax.modules.module import functional
from titanax.parallel import collectives
from titanax.parallel import layout as layout_lib
from titanax.parallel.layout import Layout
from titanax.parallel.plan import Plan
from titanax.train import learner as learner_lib
from titanax.train import step as step_lib
from titanax.train.compiled_step import CompiledStep
from titanax.train.objective import ModelLoss, Objective
from titanax.train.precision import Precision
from titanax.train.state_sharding import StateSharding
from titanax.train.user_step import UserStep


class StepBuilder:
    """Makes the train and eval steps of one run (its mesh, plan, layout and model)."""

    def __init__(self, *, mesh: Mesh, plan: Plan, layout: Layout, strategy: StateSharding,
                 model: Any, precision: Precision, adapter: learner_lib.OptimizerAdapter,
                 learner: learner_lib.Learner, nan_policy: str = "stop",
                 recompile_policy: str = "error",
                 converters: Sequence[Any] = (), objective: Optional[Objective] = None):
        self.mesh, self.plan, self.layout, self.strategy = mesh, plan, layout, strategy
        # The model converters (modules/converters.py): their scopes are entered wherever the
        # model is traced.
        self.converters = tuple(converters)
        # What the model's step trains toward (train/objective.py).
        self.objective = objective if objective is not None else ModelLoss()
        self.model, self.precision = model, precision
        self.adapter, self.learner = adapter, learner
        self.nan_policy, self.recompile_policy = nan_policy, recompile_policy
        self._unit_axes = layout_lib.unit_axes(dict(mesh.shape))

    @property
    def axes(self):
        return tuple(self.mesh.axis_names)

    @functools.cached_property
    def setup(self) -> step_lib.StepSetup:
        """What the model's local step needs, fixed at compile time."""
        dp = self.plan.config.data_parallel
        batch = self.layout.batch  # (Its size-1 axes dropped by the layout.)
        return step_lib.StepSetup(
            model=self.model, precision=self.precision, adapter=self.adapter,
            learner=self.learner, mesh_shape=dict(self.mesh.shape), data_axis=batch.data_axis,
            # The loss is a token-weighted mean over every axis the tokens are split over.
            batch_axes=batch.token_axes, accumulate_steps=self.plan.accumulate_steps,
            state_sharding=self.strategy, nan_policy=self.nan_policy,
            sync_metrics=dp.sync_metrics if dp is not None else True,
            pipeline=self.plan.config.pipeline_parallel, fold_axes=batch.fold_axes,
            layer_summed_axes=batch.layer_summed_axes, objective=self.objective)

    # --- Batches -------------------------------------------------------------------------------

    def batch_specs(self, batch: Any) -> Any:
        """The batch split as the layout says (rows on the leading dimension, the sequence on
        the second when it is split)."""
        return layout_lib.map_specs(lambda spec: layout_lib.without_axes(spec, self._unit_axes),
                                    self.layout.batch.specs(batch))

    def check_batch(self, batch: Any) -> None:
        """A batch of global arrays must split into the plan's shards and microbatches (host
        batches are checked where they are placed)."""
        leaves = jax.tree_util.tree_leaves(batch)
        if leaves and np.ndim(leaves[0]):
            self.plan.check_batch_size(int(np.shape(leaves[0])[0]), self.mesh)

    # --- Steps ---------------------------------------------------------------------------------

    def local_step(self, step_fn: Optional[Callable]):
        """The local-step protocol's implementation: the model's step, or the user's."""
        if step_fn is None:
            if self.model is None:
                raise errors.StepError("no model and no step function", path="engine.model",
                                       suggestion="configure a model, or pass a @step_fn to fit")
            return step_lib.ModelStep(self.setup)
        self.plan.check_hand_written_step(state_split=self.strategy.shard_axis is not None)
        if not isinstance(self.objective, ModelLoss):
            raise errors.StepError(
                f"a hand-written @step_fn computes its own loss, and this run trains the "
                f"{self.objective.name} objective", path="objective",
                suggestion="let the engine run its model step, or leave the objective the "
                           "model's loss")
        if not self.strategy.trainable.everything:
            raise errors.StepError(
                "a hand-written @step_fn applies its gradients to every param, and this run "
                "freezes some (a model converter's)", path="engine.model",
                suggestion="drop the converter for a hand-written step, or let the engine run "
                           "its model step")
        return UserStep(step_fn, axes=self.axes, data_axis=self.plan.dp_axis,
                        param_specs=self.layout.param_specs, precision=self.precision)

    def _shard_map(self, fn, in_specs, out_specs):
        return jax.shard_map(bound_to(fn, self.layout.axis_binding, self.converters),
                             mesh=self.mesh,
                             in_specs=in_specs, out_specs=out_specs)

    def train_step(self, step_fn: Optional[Callable], state_specs: Any) -> CompiledStep:
        """The jitted train step ``(state, batch) -> (state, metrics)``, the state donated."""
        local = self.local_step(step_fn)
        metric_spec = layout_lib.without_axes(local.metric_spec, self._unit_axes)

        def step(state, batch):
            return self._shard_map(local.train, in_specs=(state_specs, self.batch_specs(batch)),
                                   out_specs=(state_specs, metric_spec))(state, batch)

        return CompiledStep(jax.jit(step, donate_argnums=0), name="train step",
                            policy=self.recompile_policy)

    def eval_step(self, step_fn: Optional[Callable]) -> CompiledStep:
        """The jitted forward-only step ``(params, batch) -> metrics``."""
        local = self.local_step(step_fn).eval

        def run(params, batch):
            return self._shard_map(local, in_specs=(self.layout.param_specs,
                                                    self.batch_specs(batch)),
                                   out_specs=PartitionSpec())(params, batch)

        return CompiledStep(jax.jit(run), name="eval step", policy="allow")

    def model_method(self, method: str, *, constants: Tuple[Any, ...] = ()) -> Callable:
        """``jit(shard_map(model.<method>))`` over the run's mesh: ``(params, *inputs) ->
        outputs``, inputs and outputs split over the batch axes on their first dimension, the
        params in the run's layout (FSDP shards gathered first) -- the model's logits on the
        mesh it trains on. ``constants``: Python values passed after the inputs (a sampling
        temperature)."""
        # Its inputs are whole rows, the same on every context rank: no sequence is split.
        local = bound_to(self._model_call(method),
                         self.layout.axis_binding.without(axis_binding.SEQUENCE),
                         self.converters)
        batch_spec = self._batch_spec()

        def run(params, *inputs):
            in_specs = (self.layout.param_specs,) + (batch_spec,) * len(inputs)
            return jax.shard_map(lambda p, *xs: local(p, xs + tuple(constants)), mesh=self.mesh,
                                 in_specs=in_specs,
                                 out_specs=batch_spec, check_vma=False)(params, *inputs)

        return jax.jit(run)

    def generation(self, *, max_new_tokens: int, temperature: Optional[float] = None,
                   top_p: float = 1.0) -> Callable:
        """``(params, prompt_ids, key) -> new ids`` through ``model.generate`` on the run's
        mesh (``sampler``'s tokens, every prompt of one length)."""
        sample = self.sampler(max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=top_p)
        return jax.jit(lambda params, prompt_ids, key: sample(params, prompt_ids, None,
                                                              key)["tokens"])

    def sampler(self, *, max_new_tokens: int, temperature: Optional[float] = None,
                top_p: float = 1.0, end_ids: Sequence[int] = ()) -> Callable:
        """``(params, prompt_ids, prompt_lengths, key) -> {"tokens", "logps", "entropy"}``
        through ``model.sample`` on the run's mesh (rows over the batch axes, heads over TP;
        ``prompt_lengths`` None: every prompt fills its row, else they are left-padded);
        each batch shard folds its place into ``key``, so rows sample independently wherever
        they live. With ``end_ids`` decoding stops once every row of the batch has ended."""
        # Decoding has no sequence to split (over a context axis or the TP axis).
        local = bound_to(self._model_call("sample"), self.layout.axis_binding.without(
            axis_binding.SEQUENCE, axis_binding.RESIDUAL_SEQUENCE), self.converters)
        batch_spec = self._batch_spec()
        # Rows only: a sequence axis holds copies of each prompt, and must sample alike.
        batch_axes = self.layout.batch.row_axes

        def shard(params, prompt_ids, prompt_lengths, key):
            for axis in batch_axes:
                key = jax.random.fold_in(key, collectives.axis_index(axis))
            inputs = {"prompt_ids": prompt_ids, "key": key, "max_new_tokens": max_new_tokens,
                      "temperature": temperature, "top_p": top_p,
                      "prompt_lengths": prompt_lengths}
            if end_ids:
                inputs.update(end_ids=tuple(end_ids), agree_over=tuple(
                    a for a in batch_axes if a not in self._unit_axes))
            return local(params, inputs)

        def run(params, prompt_ids, prompt_lengths, key):
            if prompt_lengths is None:
                fn, args = (lambda p, ids, k: shard(p, ids, None, k)), (params, prompt_ids, key)
            else:
                fn, args = shard, (params, prompt_ids, prompt_lengths, key)
            in_specs = (self.layout.param_specs,) + (batch_spec,) * (len(args) - 2) + (
                PartitionSpec(),)
            return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=batch_spec,
                                 check_vma=False)(*args)

        return jax.jit(run)

    def decode_placement(self) -> OnMesh:
        """Where the decode engine (titanax/decoding) runs on this run's mesh: each batch shard
        its own slots and pool, key/value heads split as the attention's, params gathered and
        cast as ``sampler``'s."""
        self.plan.check_whole_model_call("the decode engine", self.mesh)
        binding = self.layout.axis_binding.without(axis_binding.SEQUENCE,
                                                   axis_binding.RESIDUAL_SEQUENCE)
        kv_axis = binding.axis(axis_binding.KV_HEADS)
        return OnMesh(mesh=self.mesh, param_specs=self.layout.param_specs,
                      row_spec=self._batch_spec(),
                      kv_heads_axis=None if kv_axis in self._unit_axes else kv_axis,
                      bound=lambda fn: bound_to(fn, binding, self.converters),
                      local_params=self._params_for_compute)

    def _batch_spec(self) -> PartitionSpec:
        return layout_lib.without_axes(self.layout.batch.row_spec(), self._unit_axes)

    def _model_call(self, method: str) -> Callable:
        """``(local params, inputs) -> model.<method>(*inputs)`` in evaluation mode, in local
        view, where the plan lets the whole model run on each device (Plan.check_whole_model_call).
        """
        if self.model is None:
            raise errors.StepError("there is no model", path="engine.model",
                                   suggestion="configure a model")
        self.plan.check_whole_model_call(f"model.{method}", self.mesh)
        model = self.model

        def local(params, inputs):
            outputs, _ = functional(model, None, self._params_for_compute(params), inputs,
                                    method=method, is_training=False)
            return outputs

        return local

    def _params_for_compute(self, params: Any) -> Any:
        """A shard's params as the whole model computes with them: FSDP's shards gathered,
        cast to the compute dtype."""
        if self.setup.gathering is not None:
            params = self.setup.gathering.gather_all(params)
        return self.precision.cast_for_compute(params)

    # --- What the model's step reports ---------------------------------------------------------

    def schedule_metrics(self, local_rows: int) -> Dict[str, float]:
        """Metrics fixed by the schedule (a pipeline's bubble) for batch shards of
        ``local_rows`` rows; empty for hand-written steps."""
        if self.model is None:
            return {}
        return self.setup.gradients.schedule_metrics(local_rows)


def bound_to(fn: Callable, binding: Any, converters: Sequence[Any] = ()) -> Callable:
    """``fn`` run with ``binding`` as the layers' axis binding (parallel/axis_binding.py) and the
    ``converters``' scopes (modules/converters.py: LoRA's adapter settings): the step's
    functions are traced inside ``shard_map``, where layers ask for them."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with axis_binding.bound(binding), converters_lib.scopes(converters):
            return fn(*args, **kwargs)

    return run
