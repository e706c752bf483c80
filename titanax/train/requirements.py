"""What a feature needs of the plan and the model, each refusal written once.

Objectives (``titanax/objectives/``) and the in-loop lm-eval evaler call these from their checks
at build: a feature that reads whole rows cannot run where a plan splits them, and one that
compares token-by-token sampling with whole-row training (or batches differently from how it
was scored) cannot use a mixture of experts that drops tokens by group size.
"""

from __future__ import annotations

from typing import Any, Sequence

from titanax import errors

# The plan parts that split a row over devices: its sequence (context parallelism) or its
# layers' run over microbatches in stages (pipeline parallelism).
ROW_SPLITTING_PARTS = ("context_parallel", "pipeline_parallel")


def require_whole_rows(plan_cfg: Any, *, why: str, suggestion: str,
                       parts: Sequence[str] = ROW_SPLITTING_PARTS) -> None:
    """A PlanError naming the first of ``parts`` the plan uses: ``why`` says what needs the
    whole row."""
    for part in parts:
        if getattr(plan_cfg, part, None) is not None:
            raise errors.PlanError(f"{why}, which {part} splits", path=f"plan.{part}",
                                   suggestion=suggestion)


def require_dropless(model: Any, *, why: str, suggestion: str = "use dispatch='dropless'"
                     ) -> None:
    """A ConfigError when the model is a capacity-limited mixture of experts (it drops tokens
    by how many share a group): ``why`` says what would then differ."""
    moe = getattr(getattr(model, "config", None), "moe", None)
    if moe is not None and moe.dispatch == "capacity":
        raise errors.ConfigError(
            f"a capacity-limited mixture of experts drops tokens by how many share a group: "
            f"{why}", path="model.moe.dispatch", suggestion=suggestion)


def input_sources(cfg: Any):
    """``(config path, source class)`` of the train input and every evaler input that has a
    source (the data an objective trains or evaluates on)."""
    inputs = [("train_input", cfg.train_input)] + [
        (f"evalers[{name!r}].input", e.input) for name, e in cfg.evalers.items()
        if getattr(e, "input", None) is not None]
    for where, input_cfg in inputs:
        kind = getattr(getattr(input_cfg, "source", None), "klass", None)
        if kind is not None:
            yield where, kind
