"""The seed's explicit pipeline stages: ``Stage(name, param_filter, fwd)``, one per pipe device.

Where the stacked path cuts one ``Repeat`` stack into equal slices, explicit stages may differ in
everything -- a conv stage feeding a dense stage, say. Each stage owns the params whose paths match
its ``param_filter`` globs and runs ``fwd(params_subset, x) -> y``: stage 0 gets the microbatch
(the batch dict's rows), stage ``i > 0`` the previous stage's output, and the last stage's output
goes to the model's ``loss(outputs, batch) -> (loss, aux with "loss_sum")``, and the model's
``loss_weight(batch)`` says what the loss is a mean over (examples, tokens, weights), so
microbatches combine into exactly the unpipelined loss.

How it runs inside the one ``shard_map`` step: every pipe device holds all stages' params
(replicated over ``pipe``; the stacked path splits them 1/S) and picks its stage with
``lax.switch`` on its pipe index. Activations cross a boundary as one buffer shape for all
boundaries: ``[rows, width]`` with ``width`` the largest flattened boundary activation, padded
with zeros (its padding gets zero gradient). The vjp of the branches a device did not take is zero,
so each device's gradient holds its own stage's params only and the sum over ``pipe`` (the
reducer's, for params replicated there) assembles the whole gradient.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from titanax import errors
from titanax.modules import functional
from titanax.modules.context import flat_summaries, refuse_state_updates
from titanax.parallel import collectives
from titanax.parallel.sharding import path_string


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage: its name, the param path globs it owns, and its forward."""

    # Shown in errors and explain().
    name: str
    # fnmatch globs over param paths ("conv*", "dense/*"); a param belongs to the first stage
    # whose filter matches, and every param must belong to a stage.
    param_filter: Sequence[str]
    # (params_subset, x) -> y: params_subset keeps the param tree's nesting, pruned to this
    # stage's leaves; x is the microbatch (stage 0) or the previous stage's output. It gets no
    # PRNG key and no is_training: explicit stages run deterministic layers (no dropout), the
    # same in training and in evaluation.
    fwd: Callable[[Any, Any], Any]

    def __post_init__(self):
        where = f"plan.pipeline_parallel.stages[{self.name!r}]"
        if isinstance(self.param_filter, str) or not self.param_filter or not all(
                isinstance(p, str) for p in self.param_filter):
            raise errors.PlanError(
                f"param_filter must be a non-empty list of glob strings, got "
                f"{self.param_filter!r}", path=f"{where}.param_filter",
                suggestion="e.g. param_filter=['conv0/*', 'conv1/*']")
        if not callable(self.fwd):
            raise errors.PlanError(f"fwd must be callable, got {self.fwd!r}",
                                   path=f"{where}.fwd",
                                   suggestion="pass a function (params_subset, x) -> y")

    def __repr__(self) -> str:  # Shown in config dumps and resume diffs.
        name = getattr(self.fwd, "__qualname__", type(self.fwd).__name__)
        return (f"Stage(name={self.name!r}, param_filter={list(self.param_filter)!r}, "
                f"fwd={getattr(self.fwd, '__module__', '?')}.{name})")


def owners(params: Any, stages: Sequence[Stage]) -> Dict[str, int]:
    """``{param path: index of the stage that owns it}``, checked: every param owned, no stage
    without params."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    owned: Dict[str, int] = {}
    unowned: List[str] = []
    for path, _ in flat:
        name = path_string(path)
        for index, stage in enumerate(stages):
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in stage.param_filter):
                owned[name] = index
                break
        else:
            unowned.append(name)
    if unowned:
        raise errors.PlanError(
            f"{len(unowned)} param(s) belong to no stage: {', '.join(unowned[:8])}",
            path="plan.pipeline_parallel.stages",
            suggestion="add globs matching them to a stage's param_filter (e.g. "
                       f"{unowned[0].split('/')[0]!r} + '/*')")
    empty = [s.name for i, s in enumerate(stages) if i not in owned.values()]
    if empty:
        raise errors.PlanError(f"stage(s) {', '.join(empty)} own no params",
                               path="plan.pipeline_parallel.stages",
                               suggestion="check their param_filter globs against the param "
                                          "paths (Plan.describe lists them)")
    return owned


def subset(params: Any, owned: Dict[str, int], index: int) -> Any:
    """The nested dict of ``params`` pruned to stage ``index``'s leaves."""
    def prune(tree, prefix):
        if isinstance(tree, dict):
            out = {}
            for key, value in tree.items():
                kept = prune(value, f"{prefix}{key}/")
                if kept is not None:
                    out[key] = kept
            return out or None
        return tree if owned.get(prefix[:-1]) == index else None

    return prune(params, "") or {}


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

    # --- Parts of the pipelined computer ---------------------------------------------------------

    def split(self, params: Any) -> Tuple[Any, Any]:
        """(params outside the stages, params the stages run on): all of them run in stages."""
        return {}, params

    @staticmethod
    def join(top_grads: Any, stage_grads: Any) -> Any:
        del top_grads
        return stage_grads

    def embed(self, top: Any, microbatch: Any, index, key, is_training: bool) -> jax.Array:
        """Stage 0 reads its microbatch itself: the pipeline's input buffer is zeros."""
        del top, index, key, is_training
        leaf = jax.tree_util.tree_leaves(microbatch)[0]
        zeros = jnp.zeros((leaf.shape[0], self._width()), self._dtype())
        return collectives.cast_varying(zeros, tuple(collectives.varying_axes(leaf)))

    def stage(self, params: Any, x: jax.Array, index, model_stage, key, is_training: bool,
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

    def head_loss(self, top: Any, outputs: jax.Array, rows: Any, key, is_training: bool
                  ) -> Tuple[jax.Array, Dict[str, jax.Array], Dict[str, jax.Array]]:
        del top
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

    def total_weight(self, batch: Dict[str, jax.Array]) -> jax.Array:
        """What the shard's loss is a mean over: the model's ``loss_weight(batch)``."""
        weight = functional(self.model, None, {}, (batch,), method="loss_weight",
                            is_training=False)[0]
        return jnp.maximum(jnp.asarray(weight, jnp.float32), 1e-12)

    # --- Boundary shapes -------------------------------------------------------------------------

    def prepare(self, params: Any, microbatch: Any) -> None:
        """Traces each stage once (shapes only) to learn the boundary activations."""
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
