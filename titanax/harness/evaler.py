"""An evaler that runs lm-evaluation-harness tasks on the run's live params every N steps.

``--config.evalers`` takes it beside (or instead of) held-out-loss evalers::

    cfg.evalers["lm_eval"] = LMEvalEvaler.default_config().set(
        tasks=["hellaswag"], limit=200, every_n_steps=500)

or from the command line, the key ``lm_eval`` creating it (``Engine.Config.new_entries``)::

    --config.evalers['lm_eval'].tasks="['hellaswag']" --config.evalers['lm_eval'].limit=200 \
        --config.evalers['lm_eval'].every_n_steps=500 --config.evalers['lm_eval'].at_start=true

``apply_chat_template`` renders the requests as a chat-tuned model reads them; ``at_start``
(every evaler's) gives the step-0 baseline.

Each evaluation runs the tasks through ``TitanaxLM`` on the params as they are at that step, on
the training mesh (no copy, no export), and logs ``lm_eval/<task>/<metric>`` (lm-eval's metric
name, with its filter when not "none": ``acc``, ``exact_match_strict-match``) to every logger.
It keeps no state of its own: a resumed run goes on evaluating at its steps.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional

from titanax import errors
from titanax.config import REQUIRED, Required
from titanax.data.pipeline import Input
from titanax.train.evaler import Evaler


class LMEvalEvaler(Evaler):
    """lm-eval ``tasks`` on the live model every ``every_n_steps`` (and after training)."""

    class Config(Evaler.Config):
        # It reads no input: lm-eval's tasks bring their documents.
        input: Optional[Input.Config] = None
        # lm-eval task (or group) names.
        tasks: Required[List[str]] = REQUIRED
        # A directory of your own task YAMLs.
        include_path: Optional[str] = None
        # Few-shot examples per request (None: the task's).
        num_fewshot: Optional[int] = None
        # Documents per task (a fraction below 1; None: all).
        limit: Optional[float] = None
        # Requests per compiled batch.
        batch_size: int = 16
        # Tokens a generation may take when its task does not say.
        max_gen_toks: int = 256
        # Render each request through the model's chat template (lm-eval's
        # --apply_chat_template): what a chat-tuned model is asked as it was trained.
        apply_chat_template: bool = False
        # With apply_chat_template: few-shot examples as earlier turns of the conversation
        # (False: all in the first user turn).
        fewshot_as_multiturn: bool = True

        def _validate_values(self):
            yield from super()._validate_values()
            if isinstance(self.tasks, list) and not self.tasks:
                yield "tasks", "is empty: name the lm-eval tasks to run"
            if self.include_path is not None and not os.path.isdir(self.include_path):
                yield "include_path", (f"{self.include_path} is not a directory (of task "
                                       f"YAMLs)")
            if self.num_fewshot is not None and self.num_fewshot < 0:
                yield "num_fewshot", f"must be >= 0, got {self.num_fewshot}"
            if self.limit is not None and not (math.isfinite(self.limit) and self.limit > 0):
                yield "limit", f"must be > 0 (or None: every document), got {self.limit}"
            elif self.limit is not None and self.limit >= 1 and self.limit != int(self.limit):
                yield "limit", (f"is a count of documents (>= 1) or a fraction of them (< 1), "
                                f"got {self.limit}")
            if self.batch_size < 1:
                yield "batch_size", f"must be >= 1, got {self.batch_size}"
            if self.max_gen_toks < 1:
                yield "max_gen_toks", f"must be >= 1, got {self.max_gen_toks}"

    # What its metrics are logged under: lm_eval/<task>/<metric>.
    metric_prefix = "lm_eval"

    def __init__(self, cfg=None, **fields):
        super().__init__(cfg, **fields)
        self._lm = None
        self._tasks = None  # lm-eval's TaskManager (its index of tasks), built once.

    def check_engine(self, engine: Any) -> None:
        """Before the run trains (``Engine.build``): the tasks exist, and the plan runs the
        whole model on each device's rows as TitanaxLM needs (no pipeline or context
        parallelism; a mixture of experts routes without capacity, which batching would
        change)."""
        where = f"evalers[{self.config.name!r}]"
        plan = engine.config.plan
        for part in ("pipeline_parallel", "context_parallel"):
            if getattr(plan, part) is not None:
                raise errors.PlanError(
                    "an lm-eval evaler runs whole rows through the whole model on each "
                    f"device, which {part} splits", path=f"plan.{part}",
                    suggestion=f"evaluate the run's checkpoints with python -m "
                               f"titanax.evaluate --trainer_dir=... (or drop {where})")
        moe = getattr(getattr(engine.model, "config", None), "moe", None)
        if moe is not None and moe.dispatch == "capacity":
            raise errors.ConfigError(
                "a capacity-limited mixture of experts drops tokens by how many share a "
                "group: an lm-eval score would depend on how the requests are batched",
                path="model.moe.dispatch",
                suggestion="use dispatch='dropless', or evaluate the checkpoints with python "
                           "-m titanax.evaluate --trainer_dir=... (it routes dropless)")
        from titanax.harness import task_loading  # pylint: disable=import-outside-toplevel
        task_loading.unknown_tasks(manager=self.task_manager(), tasks=self.config.tasks,
                                   include_path=self.config.include_path, paths=self._paths())

    def prepare(self) -> None:
        """When the run starts (not at build: ``--compile_only`` reads no data): the tasks load
        and hold their few-shot examples. Each evaluation builds them afresh, as lm-eval does."""
        from titanax.harness import task_loading  # pylint: disable=import-outside-toplevel
        task_loading.check_loadable(manager=self.task_manager(), tasks=self.config.tasks,
                                    num_fewshot=self.config.num_fewshot, paths=self._paths())

    def _paths(self) -> Dict[str, str]:
        where = f"evalers[{self.config.name!r}]"
        return {field: f"{where}.{field}" for field in ("tasks", "include_path", "num_fewshot")}

    def task_manager(self) -> Any:
        if self._tasks is None:
            from titanax.harness import task_index  # pylint: disable=import-outside-toplevel
            self._tasks = task_index.task_manager(include_path=self.config.include_path,
                                                  tasks=self.config.tasks)
        return self._tasks

    def evaluate_engine(self, engine: Any) -> Dict[str, float]:
        """The tasks' metrics on ``engine``'s model and current params, ``<task>/<metric>``."""
        import lm_eval  # pylint: disable=import-outside-toplevel
        from titanax.harness.lm import TitanaxLM, transformers_tokenizer  # pylint: disable=import-outside-toplevel
        from titanax.train import saved_run  # pylint: disable=import-outside-toplevel
        cfg = self.config
        if self._lm is None:  # (Its compiled programs are kept between evaluations.)
            train = engine.config.train_input
            source = engine.config.init_from
            self._lm = TitanaxLM(
                engine=engine, tokenizer=transformers_tokenizer(
                    getattr(train, "tokenizer", None), source),
                batch_size=cfg.batch_size, max_gen_toks=cfg.max_gen_toks,
                end_ids=saved_run.generation_end_ids(source))
        limit = int(cfg.limit) if cfg.limit is not None and cfg.limit >= 1 else cfg.limit
        # No bootstrapped standard errors (they are not logged, and lm-eval computes them in
        # a pool of processes forked from this one) and no per-request samples kept.
        results = lm_eval.simple_evaluate(
            model=self._lm, tasks=list(cfg.tasks), num_fewshot=cfg.num_fewshot, limit=limit,
            task_manager=self.task_manager(), bootstrap_iters=0, log_samples=False,
            **({"apply_chat_template": True, "fewshot_as_multiturn": cfg.fewshot_as_multiturn}
               if cfg.apply_chat_template else {}))
        return metrics_by_name(results or {})


def metrics_by_name(results: Dict[str, Any]) -> Dict[str, float]:
    """lm-eval's ``results`` as ``<task>/<metric>`` numbers (``<metric>_<filter>`` for a filter
    other than "none"; no standard errors)."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, filter_name = key.split(",", 1)
            name = metric if filter_name == "none" else f"{metric}_{filter_name}"
            out[f"{task}/{name}"] = float(value)
    return out
