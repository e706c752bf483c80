"""The objective seam: what a run trains its model toward, behind one interface.

The Engine, the training loop and the gradient computer know an objective only through this
class; each objective (``titanax/objectives/``: preference losses, GRPO, KTO, on-policy
distillation) is a module of its own above the machinery it plugs into, and ``ModelLoss`` --
the model's own ``forward(batch) -> (loss, aux)`` -- is the default. An objective owns

* its checks against the run's plan, model and data, made once at build (``check``);
* the frozen models it needs beside the trained one (``frozen_specs`` / ``frozen_params``: a
  reference or a teacher as another top-level key of the params, never trained);
* the batches it trains on (``batches``: the train input's rows as they are, or a stream that
  samples and scores them) and what ``--compile_only`` builds in their place
  (``abstract_batch``);
* its loss on one device's rows (``loss``), written on the model's primitives and run in the
  model's context, and its metrics (model summaries under ``metrics/``; host metrics beside
  each batch);
* what ``--explain`` and ``--compile_only`` say about it (``describe``, ``compile_report``),
  and the metrics the console shows first (``console_columns``).

Every method has the model-loss behaviour here, so an objective overrides only what differs.
``run`` is the Engine (its mesh, plan, model, layout, inputs and steps), passed in rather than
held, so an objective stays a config-built value with no reference back to the run.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import jax

from titanax import errors
from titanax.config import Configurable
from titanax.modules.context import OutputCollection
from titanax.modules.module import functional
from titanax.train import requirements

# The model summaries an objective reports under its own metric names (``metrics/<name>`` of
# the model's root -> ``<name>`` in metrics.csv, as TRL names them).
OBJECTIVE_METRICS = "metrics"


class Objective(Configurable):
    """The model's own loss; subclasses change what differs (see the module docstring)."""

    class Config(Configurable.Config):
        pass

    # Batch fields kept in float32 under a lower compute precision (an RL rollout's old
    # log-probs and advantages, which bfloat16 would round by ~1%).
    exact_fields: Tuple[str, ...] = ()
    # Whether the pipeline schedules can stage it (they run the model's forward in stages).
    staged_by_pipelines: bool = False
    # The data sources whose rows it trains on; empty: plain rows -- any source that declares
    # no objective of its own (a source's ``READ_BY``: what its rows are, e.g. preference pairs).
    sources: Tuple[type, ...] = ()
    # The metrics a user judges it by, first on the console's progress lines (loggers.Basic).
    console_columns: Tuple[str, ...] = ("loss",)
    # Whether its loss is the model's own forward, which also trains what the model adds to
    # it (a Decoder's multi-token-prediction depths); elsewhere those would only decay.
    trains_model_extras: bool = False

    # --- At build ------------------------------------------------------------------------------

    def check(self, run: Any) -> None:
        """Refuses (a TitanaxError naming the config path) what this objective cannot train:
        the plan, the model or the data. Called once the run's model and plan exist;
        subclasses add theirs to these (the data it reads, a pipeline it cannot be staged by)."""
        self.check_sources(run.config)
        depths = getattr(run.config.model, "mtp_depths", 0)
        if depths and not self.trains_model_extras:
            raise errors.ConfigError(
                f"the {self.name} objective computes its loss from the model's primitives, so "
                f"its {depths} multi-token-prediction depth(s) would get no gradient (and "
                "weight decay alone)", path="model.mtp_depths",
                suggestion="set it to 0 for this objective")
        if not self.staged_by_pipelines:
            requirements.require_whole_rows(
                run.config.plan, parts=("pipeline_parallel",),
                why=f"the {self.name} objective computes its loss from whole rows of the model's "
                    "outputs", suggestion="train it without pipeline_parallel (DP, TP, FSDP)")

    @property
    def name(self) -> str:
        return type(self).__name__

    def check_sources(self, cfg: Any) -> None:
        """Every input this run trains or evaluates on holds rows this objective reads."""
        for where, kind in requirements.input_sources(cfg):
            read_by = getattr(kind, "READ_BY", None)
            if self.sources and not issubclass(kind, self.sources):
                raise errors.ConfigError(
                    f"reads {read_by or kind.__name__ + ' rows'}, and the {self.name} objective "
                    f"trains on {' or '.join(s.READ_BY for s in self.sources)}",
                    path=f"{where}.source",
                    suggestion=f"give it a {' or '.join(s.__name__ for s in self.sources)} "
                               "source")
            if not self.sources and read_by is not None:
                raise errors.ConfigError(
                    f"reads {read_by}, and the {self.name} objective trains on plain rows",
                    path=f"{where}.source",
                    suggestion="set the objective that trains on them (start from an experiment "
                               "that has it: llama_tiny_dpo, llama_tiny_kto, llama_tiny_grpo)")

    def input_limits(self, model_limits: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """The per-field limits the host checks each batch against (``InputLimit`` by field),
        from the model's limits of its plain rows (``input_ids`` / ``target_ids``)."""
        return model_limits

    # --- Frozen models -------------------------------------------------------------------------

    def frozen_models(self) -> Sequence[Any]:
        """The frozen models it holds (objectives/frozen.py's ``FrozenModel``: ``specs(model
        specs)`` and ``params(start=, run=)``, each under a params key of its own)."""
        return ()

    def frozen_specs(self, model_specs: Dict[str, Any], *, run: Any) -> Dict[str, Any]:
        """Extra top-level params keys (frozen ParameterSpecs) this objective holds beside the
        model's: e.g. ``{"reference": <a frozen copy of model_specs>}``. Empty: none."""
        del run
        return {key: value for frozen in self.frozen_models()
                for key, value in frozen.specs(model_specs).items()}

    def frozen_params(self, *, start: Dict[str, Any], run: Any) -> Dict[str, Any]:
        """The values of ``frozen_specs``'s keys for a fresh run whose trained model starts at
        ``start`` (the model's own params, in the run's shards and storage dtype)."""
        return {key: value for frozen in self.frozen_models()
                for key, value in frozen.params(start=start, run=run).items()}

    # --- Batches -------------------------------------------------------------------------------

    def batches(self, made_input: Any, *, run: Any) -> Iterator[Tuple[Any, Dict[str, float]]]:
        """``(host batch, host metrics)`` pairs the steps train on, from the train input (its
        rows as they are here; a sampling objective's rollouts of them)."""
        del run
        return PlainBatches(iter(made_input))

    def takes_user_data(self) -> bool:
        """Whether ``fit(data=...)`` may hand it batches (a sampling objective makes its own)."""
        return True

    def abstract_batch(self, run: Any
                       ) -> Optional[Tuple[Dict[str, Any], int, int, Tuple[str, ...]]]:
        """``(fields {name: dtype}, row length, global rows, the fields with one value per row)``
        of the batches it trains on, for ``--compile_only``; None: those the train input's
        source declares."""
        del run
        return None

    # --- The loss ------------------------------------------------------------------------------

    def loss(self, model: Any, params: Any, batch: Any, *, key: Optional[jax.Array],
             is_training: bool, batch_axes: Sequence[str] = ()
             ) -> Tuple[Tuple[jax.Array, Dict[str, Any]], OutputCollection]:
        """``((loss, aux), output collection)`` on this device's rows, ``params`` in the
        compute dtype: aux holds the count the loss is a mean over (``num_tokens`` or
        ``num_examples``) and ``loss_sum``; the collection the model's summaries and state
        updates. ``batch_axes``: the mesh axes the batch's rows are split over (a statistic of
        the whole batch -- KTO's KL estimate -- is a psum over them; inside ``shard_map``).
        Here: the model's ``forward(batch)``."""
        del batch_axes
        return functional(model, key, params, (batch,), is_training=is_training)

    # --- Reports -------------------------------------------------------------------------------

    def describe(self) -> Optional[str]:
        """Its lines for ``--explain`` (None: nothing beyond the model's loss)."""
        return None

    def compile_report(self, run: Any, *, state: Any,
                       train_arguments: int) -> Dict[str, int]:
        """Extra per-device bytes for ``--compile_only`` (a sampler's); empty: none."""
        del run, state, train_arguments
        return {}


class ModelLoss(Objective):
    """The model's own ``forward(batch) -> (loss, aux)``: next-token cross-entropy for a
    language model (pretraining, SFT), or whatever loss a model defines."""

    staged_by_pipelines = True
    trains_model_extras = True


class PlainBatches:
    """An iterator of host batches as ``(batch, {})`` pairs (no host metrics), its position
    saved and restored as the wrapped iterator's (``get_state`` / ``set_state``, when it has
    them)."""

    def __init__(self, iterator: Iterator[Any]):
        self.iterator = iterator

    def __iter__(self) -> "PlainBatches":
        return self

    def __next__(self) -> Tuple[Any, Dict[str, float]]:
        return next(self.iterator), {}

    def __getattr__(self, name: str) -> Any:
        if name in ("get_state", "set_state", "at_boundary"):
            return getattr(self.iterator, name)
        raise AttributeError(name)
