"""The seed's explicit stages as a model's pipeline parts (``modules/pipeline_parts.py``).

How ``Stage(name, param_filter, fwd)`` lists (``parallel/stages.py``) run inside the one
``shard_map`` step: every pipe device holds all stages' params (replicated over ``pipe``; the
stacked path splits them 1/S) and picks its stage with ``lax.switch`` on its pipe index. Stage 0
gets the microbatch (the batch dict's rows), stage ``i > 0`` the previous stage's output, and the
last stage's output goes to the model's ``loss(outputs, batch) -> (loss, aux with "loss_sum")``;
the model's ``loss_weight(batch)`` says what the loss is a mean over (examples, tokens, weights),
so microbatches combine into exactly the unpipelined loss.

Activations cross a boundary as one buffer shape for all boundaries: ``[rows, width]`` with
``width`` the largest flattened boundary activation, padded with zeros (its padding gets zero
gradient). The vjp of the branches a device did not take is zero, so each device's gradient holds
its own stage's params only and the sum over ``pipe`` (the reducer's, for params replicated
there) assembles the whole gradient.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from titanax import errors
from titanax.modules.context import flat_summaries, refuse_state_updates
from titanax.modules.module import functional
from titanax.parallel import collectives
from titanax.parallel.stages import Stage, owners, subset
from titanax.utils.dtypes import at_least_float32


class ExplicitStages:
    """The pipelined gradient computer's parts for a list of ``Stage``s (see the module doc)."""

    def __init__(self, *, model: Any, stages: Sequence[Stage], num_stages: int, pipe_axis: str):
        if len(stages) != num_stages:
            raise errors.PlanError(
                f"{len(stages)} stages for a pipe axis {pipe_axis!r} of {num_stages} devices",
                path="plan.pipeline_parallel.stages",
                suggestion=f"declare one Stage per device of {pipe_axis!r} ({num_stages}), or "
                           "resize the axis")
        for method, signature in (("loss", "loss(outputs, batch) -> (loss, aux)"),
                                  ("loss_weight", "loss_weight(batch) -> the loss's denominator")):
            if not callable(getattr(model, method, None)):
                raise errors.PlanError(
                    f"{type(model).__qualname__} has no {signature}: explicit stages need it",
                    path="model", suggestion=f"give the model a {method} method (see "
                                             f"CNNClassifier.{method})")
        names = [stage.name for stage in stages]
        if len(set(names)) != len(names):
            raise errors.PlanError(f"stage names repeat: {names}",
                                   path="plan.pipeline_parallel.stages",
                                   suggestion="give every stage its own name")
        self.model = model
        self.stages = list(stages)
        self.pipe_axis = pipe_axis
        self._owned: Optional[Dict[str, int]] = None
        self._shapes: Optional[List[jax.ShapeDtypeStruct]] = None

    # --- The pipeline-parts protocol (modules/pipeline_parts.py) ---------------------------------

    def split_params(self, params: Any) -> Tuple[Any, Any]:
        """Nothing runs outside the stages: every param is some stage's."""
        return {}, params

    @staticmethod
    def join_grads(outside_grads: Any, staged_grads: Any) -> Any:
        del outside_grads
        return staged_grads

    def first_stage_input(self, outside: Any, microbatch: Any, index, key,
                          is_training: bool) -> jax.Array:
        """An empty boundary buffer: stage 0 reads its microbatch itself (``run_stage``)."""
        del outside, index, key, is_training
        leaf = jax.tree_util.tree_leaves(microbatch)[0]
        zeros = jnp.zeros((leaf.shape[0], self._width()), self._dtype())
        axes = tuple(collectives.varying_axes(leaf))
        return collectives.cast_varying(zeros, axes) if axes else zeros

    def run_stage(self, params: Any, x: jax.Array, index, model_stage, key, is_training: bool,
                  microbatches: Any) -> Tuple[jax.Array, Dict[str, jax.Array]]:
        """Stage ``model_stage`` (this device's pipe index) on microbatch ``index``; a user's
        ``fwd`` writes no summaries."""
        del key, is_training

        def branch(i):
            def run(params, x, index):
                inputs = (jax.tree_util.tree_map(lambda v: v[index], microbatches) if i == 0
                          else self._unpack(x, self._shapes[i - 1]))
                y = self._pack(self.stages[i].fwd(subset(params, self._owned, i), inputs))
                # Branches must agree on where their output varies (stage 0 reads the batch,
                # the others the pipe-varying buffer): vary everywhere.
                return collectives.cast_varying(y, collectives.manual_axes())
            return run

        return jax.lax.switch(model_stage, [branch(i) for i in range(len(self.stages))],
                              params, x, index), {}

    def head_loss(self, outside: Any, outputs: jax.Array, rows: Any, key, is_training: bool
                  ) -> Tuple[jax.Array, Dict[str, jax.Array], Dict[str, jax.Array]]:
        del outside
        (loss, aux), collection = functional(
            self.model, key, {}, (self._unpack(outputs, self._shapes[-1]), rows), method="loss",
            is_training=is_training)
        if is_training:
            refuse_state_updates(collection, where=f"{type(self.model).__qualname__}.loss")
        if "loss_sum" not in aux:
            raise errors.PlanError(
                f"{type(self.model).__qualname__}.loss returned aux without 'loss_sum'",
                path="model.loss", suggestion="return aux['loss_sum'] (the loss summed over "
                "examples): microbatch losses are combined by it")
        return loss, aux, flat_summaries(collection.summaries)

    def loss_weight(self, batch: Dict[str, jax.Array]) -> jax.Array:
        """What the shard's loss is a mean over: the model's ``loss_weight(batch)``."""
        weight = functional(self.model, None, {}, (batch,), method="loss_weight",
                            is_training=False)[0]
        return at_least_float32(weight)

    # --- Boundary shapes -------------------------------------------------------------------------

    def for_inputs(self, params: Any, microbatch: Any) -> "ExplicitStages":
        """Learns the boundary activations (each stage traced once, shapes only) and the owner
        of every param; returns the parts ready to run."""
        self._owned = owners(params, self.stages)
        shapes = []
        x: Any = microbatch
        for i, stage in enumerate(self.stages):
            try:
                y = jax.eval_shape(stage.fwd, subset(params, self._owned, i), x)
            except errors.TitanaxError:
                raise
            except Exception as e:  # The user's fwd: say which stage failed on what input.
                raise errors.PlanError(
                    f"stage {stage.name!r} failed on its input "
                    f"{jax.tree_util.tree_map(lambda a: (a.shape, str(a.dtype)), x)}: {e}",
                    path=f"plan.pipeline_parallel.stages[{i}]",
                    suggestion="make fwd(params_subset, x) accept the previous stage's output "
                               "(stage 0: the batch dict)") from None
            if not isinstance(y, jax.ShapeDtypeStruct) or not jnp.issubdtype(y.dtype,
                                                                              jnp.floating):
                raise errors.PlanError(
                    f"stage {stage.name!r} must return one float array, got {y}",
                    path=f"plan.pipeline_parallel.stages[{i}]",
                    suggestion="return the activation the next stage (or the loss) takes")
            shapes.append(y)
            x = y
        self._shapes = shapes
        return self

    def _width(self) -> int:
        return max(int(np.prod(s.shape[1:])) for s in self._shapes)

    def _dtype(self):
        return jnp.result_type(*[s.dtype for s in self._shapes])

    def _pack(self, y: jax.Array) -> jax.Array:
        flat = y.reshape(y.shape[0], -1).astype(self._dtype())
        return jnp.pad(flat, ((0, 0), (0, self._width() - flat.shape[1])))

    @staticmethod
    def _unpack(buffer: jax.Array, shape: jax.ShapeDtypeStruct) -> jax.Array:
        rows = buffer.shape[0]
        size = int(np.prod(shape.shape[1:]))
        return buffer[:, :size].reshape((rows,) + tuple(shape.shape[1:])).astype(shape.dtype)
