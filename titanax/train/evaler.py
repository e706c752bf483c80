"""Evalers: forward-only passes over held-out data every N steps, and their summaries."""

from __future__ import annotations

from typing import Dict, Optional

from titanax.config import REQUIRED, Configurable, Required
from titanax.data.pipeline import Input
from titanax.train.gradients import LOSS_COUNTS


class Evaler(Configurable):
    """Evaluates the model on ``input`` every ``every_n_steps`` steps (and after training)."""

    class Config(Configurable.Config):
        # Name shown in logs ("<name>/loss"); set from the Engine's evalers dict key.
        name: str = "eval"
        # The held-out data.
        input: Required[Input.Config] = REQUIRED
        # Run every this many train steps; None: only after training.
        every_n_steps: Optional[int] = None
        # Batches per evaluation; None: one pass over the data (the input must not repeat).
        num_batches: Optional[int] = None
        # Also evaluate before a new run's first step (logged at step 0): the baseline the
        # training moves from.
        at_start: bool = False

        def _validate_values(self):
            if self.every_n_steps is not None and self.every_n_steps < 1:
                yield "every_n_steps", f"must be >= 1 (or None: only after training), got " \
                                       f"{self.every_n_steps}"
            if self.num_batches is not None and self.num_batches < 1:
                yield "num_batches", f"must be >= 1 (or None: one pass over the data), got " \
                                     f"{self.num_batches}"

    def due(self, step: int) -> bool:
        """At step 0 (before a new run's first step) when ``at_start``; then every
        ``every_n_steps`` steps."""
        if step == 0:
            return self.config.at_start
        every = self.config.every_n_steps
        return bool(every) and step % every == 0


def summarize(totals: Dict[str, float], batches: int) -> Dict[str, float]:
    """Per-batch sums -> the metrics people read.

    ``loss`` is the token- (or example-) weighted mean when the model reports ``loss_sum`` with a
    count, else the mean over batches; ``accuracy`` is correct / examples when reported.
    """
    out = {"loss": totals["loss"] / batches} if "loss" in totals else {}
    count = next((totals[f"aux/{name}"] for name in LOSS_COUNTS if f"aux/{name}" in totals),
                 None)
    if count:
        if "aux/loss_sum" in totals:
            out["loss"] = totals["aux/loss_sum"] / count
        if "aux/num_correct" in totals:
            out["accuracy"] = totals["aux/num_correct"] / count
        out["count"] = count
    for key, value in totals.items():
        if not key.startswith("aux/") and key != "loss":
            out[key] = value / batches
    return out
