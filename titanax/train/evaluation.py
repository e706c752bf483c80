"""Evaluation: forward-only metrics over held-out data, by the configured evalers or on demand.

``Evaluation.run_due(step)`` runs the evalers due at a step (``Evaler.every_n_steps``) and logs
``<name>/<metric>``; ``Evaluation.evaluate(compiled, params, data, steps)`` is the loop behind
``Engine.eval``: each batch through the compiled eval step, per-batch sums turned into the
token-weighted loss and accuracy by ``evaler.summarize``.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple

import jax
import numpy as np

from titanax import errors
from titanax.observe import goodput
from titanax.train import preemption
from titanax.train.evaler import Evaler, summarize

_log = logging.getLogger("titanax")


class Evaluation:
    """The run's evalers and the last results they gave."""

    def __init__(self, configs: Mapping[str, Evaler.Config]):
        self._configs = dict(configs)
        self._evalers: Optional[Dict[str, Evaler]] = None
        # The step of the latest evaluation and what it gave (the end of a run reuses them).
        self.last_step: Optional[int] = None
        self.last_results: Dict[str, Dict[str, float]] = {}
        # Evalers whose data is read as one pass (decided at their first evaluation).
        self._cut_to_one_pass: set = set()
        # Whether prepare_inputs ran (each fit() asks; the first does the work).
        self._prepared = False
        # Evalers already warned that num_batches leaves some of their rows unscored.
        self._warned: set = set()
        # Each evaler's input, built at its first evaluation (reading and tokenizing the
        # held-out documents once, not at every evaluation); iterated afresh each time.
        self._inputs: Dict[Tuple[str, bool], Iterable] = {}

    @property
    def evalers(self) -> Dict[str, Evaler]:
        """The evalers by name (built on first use)."""
        if self._evalers is None:
            self._evalers = {name: cfg.clone(name=name).instantiate()
                             for name, cfg in self._configs.items()}
        return self._evalers

    def due(self, step: int) -> bool:
        return any(e.due(step) for e in self.evalers.values())

    def run(self, step: int, *, evaluate: Callable[[Any, Optional[int]], Dict[str, float]],
            make_input: Callable[..., Iterable], loggers: Sequence[Any],
            only_due: bool = True, engine: Any = None) -> Dict[str, Dict[str, float]]:
        """Runs the evalers (those due at ``step``, or all) and logs their metrics.

        ``evaluate(data, num_batches)``: metrics over the data; ``make_input(config, where=,
        source=)``: an evaler's input, errors naming ``where`` (its config path), on ``source``
        when one is given (already built). An evaler that reads no
        input evaluates the ``engine``'s model itself (``evaluate_engine``: lm-eval tasks) and
        names its metrics (``metric_prefix``)."""
        results = {}
        for name, evaler in self.evalers.items():
            if only_due and not evaler.due(step):
                continue
            with goodput.spent_on("evaluation"):  # (The run's goodput: not a training step.)
                if hasattr(evaler, "evaluate_engine"):
                    metrics = evaler.evaluate_engine(engine)
                else:
                    data, batches = self._at_most_one_pass(evaler, make_input,
                                                           f"evalers[{name!r}]")
                    metrics = evaluate(data, batches)
            results[name] = metrics
            prefix = getattr(evaler, "metric_prefix", name)
            for logger in loggers:
                logger.log_dict({f"{prefix}/{k}": v for k, v in metrics.items()}, step)
        if results:  # (Nothing due: the step's evaluation is still to come.)
            self.last_step, self.last_results = step, results
        return results

    def prepare_inputs(self, make_input: Callable[..., Iterable]) -> None:
        """Builds each evaler's input now (at the start of a run, and for ``--explain``): what
        its data cuts, drops or leaves unscored is reported before the first step, not at the
        first evaluation; an evaler that reads its own data (``prepare``) checks it now."""
        if self._prepared:
            return
        self._prepared = True
        for name, evaler in self.evalers.items():
            if hasattr(evaler, "prepare"):  # (An evaler of its own data: lm-eval's tasks.)
                evaler.prepare()
            elif not hasattr(evaler, "evaluate_engine") and \
                    getattr(evaler.config, "input", None) is not None:
                self._at_most_one_pass(evaler, make_input, f"evalers[{name!r}]")

    def _at_most_one_pass(self, evaler: Evaler, make_input: Callable[..., Iterable],
                          where: str) -> Tuple[Iterable, Optional[int]]:
        """An evaler's input and how many batches to read: ``num_batches``, unless the held-out
        rows are fewer than that many batches -- a repeating input would then count some rows
        twice -- when it reads one pass instead, the last batch padded (padding weighs 0)."""
        cfg = evaler.config
        one_pass_input = cfg.input.clone(num_epochs=1, last_batch="pad")

        def built(one_pass: bool) -> Iterable:
            if (where, one_pass) not in self._inputs:
                # (The same source config either way: one read and tokenized once serves both.)
                other = getattr(self._inputs.get((where, not one_pass)), "source", None)
                self._inputs[(where, one_pass)] = make_input(
                    one_pass_input if one_pass else cfg.input, where=f"{where}.input",
                    source=other)
            return self._inputs[(where, one_pass)]

        if where in self._cut_to_one_pass:
            return built(True), None
        data = built(False)
        source = getattr(data, "source", None)
        batch = cfg.input.global_batch_size
        if cfg.num_batches is None or cfg.input.num_epochs is not None or source is None \
                or len(source) >= cfg.num_batches * batch:
            if cfg.num_batches is not None and source is not None and \
                    len(source) > cfg.num_batches * batch and where not in self._warned:
                self._warned.add(where)
                _log.warning("%s scores %d of its %d held-out rows (num_batches=%d x "
                             "global_batch_size %d); %s.num_batches=None scores them all, in "
                             "one pass", where, cfg.num_batches * batch, len(source),
                             cfg.num_batches, batch, where)
            return data, cfg.num_batches
        one_pass = math.ceil(len(source) / batch)
        self._cut_to_one_pass.add(where)
        _log.info("%s: the held-out data has %d rows, fewer than num_batches=%d x %d: "
                     "evaluating one pass (%d batch(es), the last padded) so that no row "
                     "counts twice", where, len(source), cfg.num_batches, batch, one_pass)
        return built(True), None


def evaluate(compiled: Callable[[Any, Any], Dict[str, Any]], params: Any, data: Iterable, *,
             steps: Optional[int], place: Callable[[Any], Any]) -> Dict[str, float]:
    """Forward-only metrics over ``steps`` batches of ``data`` (all of it when None);
    ``place(batch)``: a host batch as global arrays."""
    totals: Dict[str, float] = {}
    count = 0
    for index, batch in enumerate(data):
        if steps is not None and index >= steps:
            break
        preemption.stop_if_requested("the evaluation is cut short (checkpoints are saved)")
        metrics = jax.device_get(compiled(params, place(batch)))
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + float(np.asarray(value).reshape(-1)[0])
        count += 1
    if count == 0:
        raise errors.DataError("the eval data produced no batch", path="eval data",
                               suggestion="check the eval input and num_batches")
    return summarize(totals, count)
