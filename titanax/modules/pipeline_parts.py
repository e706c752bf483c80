"""What a model supplies to be pipelined: its parts, behind one protocol.

A pipeline schedule (``parallel/pipeline.py``: GPipe, circular; ``parallel/one_f_one_b.py``)
moves activations between stages and knows nothing of models. The pipelined gradient computer
(``train/pipelined_gradients.py``) runs a model's *parts* through a schedule, and the model says
what its parts are:

- a stacked decoder (GPT, and every model built as embed -> a ``Repeat`` stack -> head and loss)
  returns ``StackedStages`` from ``model.pipeline_parts(...)``: stage ``c`` runs layers
  ``c L/(vS) .. (c+1) L/(vS) - 1`` of the stack, the embedding feeds stage 0, the head and the
  loss read the last stage's output;
- the seed's explicit ``Stage(name, param_filter, fwd)`` list is ``ExplicitStages``
  (``modules/explicit_stages.py``): each stage its own function of its own params.

The protocol (``PipelineParts``) is the whole contract between a model and the schedules.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Protocol, Tuple

import jax

from titanax import errors
from titanax.modules.context import flat_summaries, refuse_state_updates
from titanax.modules.module import functional


class PipelineParts(Protocol):
    """A model cut into pipeline stages (local view, inside the step's ``shard_map``)."""

    def for_inputs(self, params: Any, microbatch: Any) -> "PipelineParts":
        """Parts that know the shapes they will see (called once per trace, before the
        schedule runs); parts whose boundaries are fixed return themselves."""

    def split_params(self, params: Any) -> Tuple[Any, Any]:
        """``(outside, staged)``: the params run outside the stages on every pipe rank
        (embeddings, final norm, head) and the params the stages run on."""

    def join_grads(self, outside_grads: Any, staged_grads: Any) -> Any:
        """The inverse of ``split_params`` for gradients."""

    def first_stage_input(self, outside: Any, microbatch: Any, index, key,
                          is_training: bool) -> jax.Array:
        """The activation that enters stage 0 for microbatch ``index``."""

    def run_stage(self, staged: Any, x: jax.Array, index, model_stage, key, is_training: bool,
                  microbatches: Any) -> Tuple[jax.Array, Dict[str, jax.Array]]:
        """Model stage ``model_stage`` on microbatch ``index``: ``(output, summaries)``."""

    def head_loss(self, outside: Any, outputs: jax.Array, rows: Any, key, is_training: bool
                  ) -> Tuple[jax.Array, Dict[str, jax.Array], Dict[str, jax.Array]]:
        """``(loss, aux with "loss_sum", summaries)`` of the last stage's outputs for ``rows``."""

    def loss_weight(self, batch: Any) -> jax.Array:
        """What the loss of ``batch`` is a mean over (tokens, examples, weights), so losses of
        microbatches add up to the unpipelined loss exactly."""


def part_key(key: Optional[jax.Array], microbatch, part: int) -> Optional[jax.Array]:
    """The dropout key of one part (0 embedding, 1 stages, 2 head) of one microbatch: the same
    whatever the schedule, so every schedule drops out the same units."""
    if key is None:
        return None
    return jax.random.fold_in(jax.random.fold_in(key, microbatch), part)


class StackedStages:
    """The parts of a model built as ``embed_batch`` -> ``decoder`` (a Repeat stack) ->
    ``head_loss``, with ``loss_weight(batch)``: stage ``c`` runs layers
    ``c L/(vS) .. (c+1) L/(vS) - 1`` of the stack."""

    def __init__(self, *, model: Any, num_stages: int, virtual_stages: int,
                 checkpoint_ratio: float, schedule: str):
        self.model = model
        layers = model.decoder.config.num_layers
        # One stage's slice of the stack: the same layer, L/(vS) times (the layout's stage
        # split checked that L divides).
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

    def for_inputs(self, params: Any, microbatch: Any) -> "StackedStages":
        """Every boundary is the decoder's residual stream: nothing to learn from the inputs."""
        del params, microbatch
        return self

    @staticmethod
    def split_params(params: Any) -> Tuple[Any, Any]:
        return {k: v for k, v in params.items() if k != "decoder"}, params["decoder"]

    @staticmethod
    def join_grads(outside_grads: Any, staged_grads: Any) -> Any:
        return {**outside_grads, "decoder": staged_grads}

    def first_stage_input(self, outside: Any, microbatch: Any, index, key,
                          is_training: bool) -> jax.Array:
        return functional(self.model, part_key(key, index, 0), outside, (microbatch,),
                          method="embed_batch", is_training=is_training)[0]

    def run_stage(self, staged, x, index, model_stage, key, is_training, microbatches=None):
        """Each layer's dropout key depends on the microbatch and its place in the whole stack
        (``first_layer``), so the schedules and stage counts drop out the same units. The
        layers also read what the model's ``stack_inputs`` takes from this microbatch (packed
        rows' segment ids and positions)."""
        first_layer = model_stage * self.layers_per_stage
        key = part_key(key, index, 1)
        layer_inputs = {}
        if microbatches is not None and hasattr(self.model, "stack_inputs"):
            layer_inputs = self.model.stack_inputs(jax.tree_util.tree_map(
                lambda v: jax.lax.dynamic_index_in_dim(v, index, keepdims=False), microbatches))

        def run(part, params, x, first):
            y, collection = functional(part, key, params,
                                       {"x": x, "first_layer": first, **layer_inputs},
                                       is_training=is_training)
            if is_training:
                refuse_state_updates(collection, where="decoder")
            return y, flat_summaries(collection.summaries, "summaries/decoder", per_layer=False)

        if not (self.remat_layers and is_training):
            return run(self.stage_layer, staged, x, first_layer)
        recomputed, kept = self.stage_parts
        split = self.remat_layers
        head = jax.tree_util.tree_map(lambda p: p[:split], staged)
        tail = jax.tree_util.tree_map(lambda p: p[split:], staged)
        x, early = jax.checkpoint(lambda p, x_in: run(recomputed, p, x_in, first_layer),
                                  prevent_cse=False)(head, x)
        y, late = run(kept, tail, x, first_layer + split)
        share = split / self.layers_per_stage  # Per-layer means, weighted by layer counts.
        return y, {k: share * early[k] + (1 - share) * late[k] for k in late}

    def head_loss(self, outside: Any, outputs: jax.Array, rows: Any, key, is_training: bool):
        (loss, aux), collection = functional(self.model, key, outside, (outputs, rows),
                                             method="head_loss", is_training=is_training)
        if is_training:
            refuse_state_updates(collection, where=f"{type(self.model).__qualname__}.head_loss")
        return loss, aux, flat_summaries(collection.summaries)

    def loss_weight(self, batch: Any) -> jax.Array:
        return functional(self.model, None, {}, (batch,), method="loss_weight",
                          is_training=False)[0]


def parts_of(model: Any, *, num_stages: int, virtual_stages: int, checkpoint_ratio: float,
             schedule: str) -> PipelineParts:
    """The model's own parts (``model.pipeline_parts``), or a refusal that says what to do."""
    make = getattr(model, "pipeline_parts", None)
    if make is None:
        raise errors.PlanError(
            f"{type(model).__qualname__} does not say how it splits into pipeline stages (no "
            "pipeline_parts method)", path="plan.pipeline_parallel",
            suggestion="give the model pipeline_parts(...) (GPT's returns StackedStages: embed "
                       "-> a Repeat stack -> head_loss), or declare the stages explicitly "
                       "(PP.stages=[Stage(name, param_filter, fwd), ...])")
    return make(num_stages=num_stages, virtual_stages=virtual_stages,
                checkpoint_ratio=checkpoint_ratio, schedule=schedule)
