"""Preference tuning (``--config.objective.*`` of ``llama_tiny_dpo``): a policy trained on pairs of
a chosen and a rejected completion (``data/preference.py``) with DPO (``sigmoid``), IPO, hinge,
SimPO or ORPO (``preference_losses.py`` has the formulas).

Both completions of every pair run through the model in one pass; each completion's log-prob is
the sum over its weighted targets. The losses that compare with a reference model (``sigmoid``,
``ipo``, ``hinge``) read the reference's log-probs from a frozen model (``frozen.py``): the
starting weights, the HF directory ``reference_from``, or with LoRA the base with its adapters
off. TRL's metrics: ``rewards/chosen`` ... ``logps/rejected``, and the held-out accuracy
(``num_correct``: pairs whose chosen reward is the higher).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Literal, Optional, Tuple

import jax
import jax.numpy as jnp

from titanax import errors
from titanax.data.preference import PreferencePairs
from titanax.modules.layers.moe import add_moe_objective
from titanax.modules.module import functional
from titanax.objectives import frozen
from titanax.objectives import preference_losses
from titanax.objectives.preference_losses import LOSSES, REFERENCE_FREE, PairLosses
from titanax.train import requirements
from titanax.train.objective import OBJECTIVE_METRICS, Objective
from titanax.utils.dtypes import at_least_float32

# The params key of the frozen reference model.
REFERENCE = "reference"
SIDES = ("chosen", "rejected")


class Preference(Objective):
    """A preference loss on pairs (see the module docstring)."""

    class Config(Objective.Config):
        # sigmoid (DPO) | ipo | hinge | simpo | orpo.
        loss: Literal["sigmoid", "ipo", "hinge", "simpo", "orpo"] = "sigmoid"
        # The loss's temperature (DPO's beta; IPO's tau; ORPO's lambda on its odds-ratio term).
        beta: float = 0.1
        # SimPO's target reward margin gamma (in units of beta x per-token log-prob).
        simpo_gamma: float = 0.5
        # A Hugging Face directory of the reference model (same architecture); None: the
        # starting weights (with LoRA: the base, its adapters off -- no second copy).
        reference_from: Optional[str] = None

        def _validate_values(self):
            if self.loss not in LOSSES:
                yield "loss", f"must be one of {', '.join(LOSSES)}, got {self.loss!r}"
            if not (math.isfinite(self.beta) and self.beta > 0):
                yield "beta", f"must be a finite number > 0, got {self.beta}"
            if not (math.isfinite(self.simpo_gamma) and self.simpo_gamma >= 0):
                yield "simpo_gamma", (f"must be a finite margin >= 0, got {self.simpo_gamma} "
                                      f"(a negative target margin rewards ranking the rejected "
                                      f"completion first)")

    sources = (PreferencePairs,)
    console_columns = ("loss", "rewards/accuracies", "rewards/margins")

    def __init__(self, cfg=None, **fields):
        super().__init__(cfg, **fields)
        self.reference = frozen.FrozenModel(key=REFERENCE, directory=self.config.reference_from,
                                            path="objective.reference_from",
                                            what="reference model")

    @property
    def needs_reference(self) -> bool:
        return self.config.loss not in REFERENCE_FREE

    def pair_losses(self, *, policy: Dict[str, jax.Array],
                    reference: Optional[Dict[str, jax.Array]],
                    tokens: Dict[str, jax.Array]) -> PairLosses:
        """The configured loss per pair (``preference_losses.pair_losses``)."""
        cfg = self.config
        return preference_losses.pair_losses(loss=cfg.loss, beta=cfg.beta,
                                             simpo_gamma=cfg.simpo_gamma, policy=policy,
                                             reference=reference, tokens=tokens)

    # --- At build ------------------------------------------------------------------------------

    def check(self, run: Any) -> None:
        super().check(run)
        if self.config.reference_from is not None and not self.needs_reference:
            raise errors.ConfigError(
                f"names the reference of a preference loss, and {self.config.loss} is "
                "reference-free", path="objective.reference_from",
                suggestion="set objective.loss to sigmoid, ipo or hinge, or drop reference_from")
        self.reference.setup(run, needed=self.needs_reference)
        requirements.require_whole_rows(
            run.config.plan, parts=("context_parallel",),
            why="a preference loss sums each completion's log-probs over its whole row",
            suggestion="train preferences without context parallelism (DP, TP, FSDP)")

    def input_limits(self, model_limits):
        if model_limits is None:
            return None
        return {f"{side}_{name}": limit for side in SIDES for name, limit in model_limits.items()}

    # --- The reference -------------------------------------------------------------------------

    def frozen_models(self):
        return (self.reference,)

    # --- The loss ------------------------------------------------------------------------------

    def loss(self, model, params, batch, *, key, is_training, batch_axes=()):
        return functional(model, key, params, (batch,), method=self._pairs_loss,
                          is_training=is_training)

    def _pairs_loss(self, model: Any, batch: Dict[str, jax.Array]
                    ) -> Tuple[jax.Array, Dict[str, Any]]:
        """Runs as a method of ``model``: the mean loss over the pairs of ``batch`` (the
        ``chosen_*`` / ``rejected_*`` rows), aux ``loss_sum``, ``num_examples`` and
        ``num_correct``; TRL's metrics as summaries."""
        rows = {name: jnp.concatenate([batch[f"{side}_{name}"] for side in SIDES])
                for name in ("input_ids", "target_ids", "weights")}
        pairs = batch["chosen_input_ids"].shape[0]
        row_inputs = (rows["input_ids"], rows["target_ids"], rows["weights"])

        def halves(values):
            return {"chosen": values[:pairs], "rejected": values[pairs:]}

        per_token = model.token_logps(rows["input_ids"], rows["target_ids"])
        policy = halves(jnp.sum(per_token * at_least_float32(rows["weights"]), axis=-1))
        reference = None
        if self.needs_reference:
            reference = halves(self.reference.call(model, method="sequence_logps",
                                                   inputs=row_inputs))
        tokens = halves(jnp.sum(at_least_float32(rows["weights"]), axis=-1))
        cfg = self.config
        out = self.pair_losses(policy=policy, reference=reference, tokens=tokens)
        weights = batch.get("weights")  # Per pair: 0 for a padding row of the last batch.
        weights = (jnp.ones((pairs,), out.loss.dtype) if weights is None
                   else at_least_float32(weights).reshape(pairs))
        count = jnp.sum(weights)
        loss_sum = jnp.sum(out.loss * weights)
        loss = loss_sum / jnp.maximum(count, 1.0)
        if cfg.loss == "orpo":
            # Its SFT term: the NLL of the chosen rows' tokens -- prompt and completion, as TRL's
            # ORPO (batch["chosen_valid"]: the targets that are tokens, not padding) -- a mean
            # over them.
            valid = at_least_float32(batch["chosen_valid"]) * weights[:, None]
            nll = -jnp.sum(per_token[:pairs] * valid) / jnp.maximum(jnp.sum(valid), 1.0)
            loss = loss + nll
            loss_sum = loss * count
        mean = lambda v: jnp.sum(v * weights) / jnp.maximum(count, 1.0)  # noqa: E731
        correct = (out.chosen_rewards > out.rejected_rewards).astype(weights.dtype)
        for name, value in (("rewards/chosen", out.chosen_rewards),
                            ("rewards/rejected", out.rejected_rewards),
                            ("rewards/accuracies", correct),
                            ("rewards/margins", out.chosen_rewards - out.rejected_rewards),
                            ("logps/chosen", policy["chosen"]),
                            ("logps/rejected", policy["rejected"])):
            model.add_summary(f"{OBJECTIVE_METRICS}/{name}", mean(jax.lax.stop_gradient(value)))
        loss = add_moe_objective(loss, model.collected_outputs())
        return loss, {"loss_sum": loss_sum, "num_examples": count,
                      "num_correct": jnp.sum(correct * weights)}

    def describe(self) -> Optional[str]:
        cfg = self.config
        reference = ("none (reference-free)" if not self.needs_reference
                     else self.reference.describe())
        return f"objective: preference loss {cfg.loss} (beta {cfg.beta}); reference: {reference}"
