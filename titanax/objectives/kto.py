"""KTO (Ethayarajh et al., 2024) on unpaired preferences (``llama_tiny_kto``): each example is one
completion labelled desirable or not (``data/unpaired.py``), no pair needed.

With the policy's and the reference's log-probs of each completion, ``r = log pi(y|x) -
log ref(y|x)`` and the batch's KL estimate ``z0`` (below), as TRL's ``KTOTrainer``:

- desirable: ``desirable_weight * (1 - sigmoid(beta * (r - z0)))``;
- undesirable: ``undesirable_weight * (1 - sigmoid(beta * (z0 - r)))``;

the loss is their mean over the examples. ``z0 = max(0, mean(log pi(y'|x) - log ref(y'|x)))``
over the *mismatched* rows of the whole batch (each prompt with another record's completion),
without gradient -- one number per step shared by every device: a psum over the batch axes
(TRL: a mean of per-device means, the same for equal shards). With the policy equal to its
reference, ``r = z0 = 0`` and every example's loss is ``weight * 1/2``.

Metrics, as TRL names them: ``kl`` (z0), ``rewards/chosen`` / ``rewards/rejected`` (``beta * r``
summed over the batch's desirable / undesirable examples over their count), ``logps/chosen`` /
``logps/rejected`` alike, ``rewards/margins`` (their difference); a held-out evaluation's
``accuracy`` is the share of examples whose reward has their label's sign.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from titanax.data.unpaired import UnpairedPreferences
from titanax.modules.layers.moe import add_moe_objective
from titanax.modules.module import functional
from titanax.objectives import frozen
from titanax.objectives.batch_statistics import batch_mean
from titanax.train import requirements
from titanax.train.objective import OBJECTIVE_METRICS, Objective
from titanax.utils.dtypes import at_least_float32

# The params key of the frozen reference model.
REFERENCE = "reference"
# The rows of an example: its own completion's, and the mismatched one's (the KL estimate's).
ROWS = ("", "kl_")


class KTO(Objective):
    """KTO's loss on labelled completions (see the module docstring)."""

    class Config(Objective.Config):
        # The temperature of the implied reward beta * log(pi / ref).
        beta: float = 0.1
        # Weights of the desirable and the undesirable examples' losses (KTO's lambda_D,
        # lambda_U; with unequal counts the paper keeps lambda_D n_D / (lambda_U n_U) in
        # [1, 4/3]).
        desirable_weight: float = 1.0
        undesirable_weight: float = 1.0
        # A Hugging Face directory of the reference model (same architecture); None: the
        # starting weights (with LoRA: the base, its adapters off -- no second copy).
        reference_from: Optional[str] = None

        def _validate_values(self):
            if not (math.isfinite(self.beta) and self.beta > 0):
                yield "beta", f"must be a finite number > 0, got {self.beta}"
            for name in ("desirable_weight", "undesirable_weight"):
                value = getattr(self, name)
                if not (math.isfinite(value) and value > 0):
                    yield name, f"must be a finite number > 0, got {value}"

    sources = (UnpairedPreferences,)
    console_columns = ("loss", "rewards/margins", "kl")

    def __init__(self, cfg=None, **fields):
        super().__init__(cfg, **fields)
        self.reference = frozen.FrozenModel(key=REFERENCE, directory=self.config.reference_from,
                                            path="objective.reference_from",
                                            what="reference model")

    # --- At build ------------------------------------------------------------------------------

    def check(self, run: Any) -> None:
        super().check(run)
        requirements.require_whole_rows(
            run.config.plan, parts=("context_parallel",),
            why="KTO sums each completion's log-probs over its whole row",
            suggestion="train KTO without context parallelism (DP, TP, FSDP)")
        self.reference.setup(run, needed=True)

    def input_limits(self, model_limits):
        if model_limits is None:
            return None
        return {prefix + name: limit for prefix in ROWS for name, limit in model_limits.items()}

    def frozen_models(self):
        return (self.reference,)

    # --- The loss ------------------------------------------------------------------------------

    def loss(self, model, params, batch, *, key, is_training, batch_axes=()):
        return functional(model, key, params, (batch, tuple(batch_axes)),
                          method=self._kto_loss, is_training=is_training)

    def _kto_loss(self, model: Any, batch: Dict[str, jax.Array],
                  batch_axes: Tuple[str, ...]) -> Tuple[jax.Array, Dict[str, Any]]:
        """Runs as a method of ``model``: the mean loss over this device's examples, aux
        ``loss_sum``, ``num_examples``, ``num_correct``; TRL's metrics as summaries."""
        rows = batch["input_ids"].shape[0]
        weights = at_least_float32(batch["weights"])
        # A padding example (the last batch's, weights 0) counts nowhere.
        example = (jnp.sum(weights, axis=-1) > 0).astype(weights.dtype)
        policy = model.sequence_logps(batch["input_ids"], batch["target_ids"], batch["weights"])
        policy_kl = jax.lax.stop_gradient(model.sequence_logps(
            batch["kl_input_ids"], batch["kl_target_ids"], batch["kl_weights"]))
        both = tuple(jnp.concatenate([batch[p + name] for p in ROWS])
                     for name in ("input_ids", "target_ids", "weights"))
        reference = self.reference.call(model, method="sequence_logps", inputs=both)
        reference, reference_kl = reference[:rows], reference[rows:]
        # (A mismatched row cut to nothing to score leaves the estimate.)
        mismatched = example * (jnp.sum(at_least_float32(batch["kl_weights"]), axis=-1) > 0)
        kl = jnp.maximum(batch_mean((policy_kl - reference_kl) * mismatched, mismatched,
                                     batch_axes), 0.0)
        label = at_least_float32(batch["label"])
        out = self.example_losses(policy=policy, reference=reference, kl=kl, label=label)
        count = jnp.sum(example)
        loss_sum = jnp.sum(out["loss"] * example)
        loss = loss_sum / jnp.maximum(count, 1.0)
        self._summaries(model, out, policy=policy, label=label, example=example, kl=kl,
                        batch_axes=batch_axes)
        loss = add_moe_objective(loss, model.collected_outputs())
        return loss, {"loss_sum": loss_sum, "num_examples": count,
                      "num_correct": jnp.sum(out["correct"] * example)}

    def example_losses(self, *, policy: jax.Array, reference: jax.Array, kl: jax.Array,
                       label: jax.Array) -> Dict[str, jax.Array]:
        """Per example (``[rows]`` summed log-probs, ``label`` 1 / 0; ``kl`` the batch's
        estimate): ``loss`` (weighted), ``reward`` (``beta * r``, no gradient), ``correct``
        (the reward's sign is the label's)."""
        cfg = self.config
        logratio = policy - reference
        desirable = cfg.desirable_weight * (1.0 - jax.nn.sigmoid(cfg.beta * (logratio - kl)))
        undesirable = cfg.undesirable_weight * (1.0 - jax.nn.sigmoid(cfg.beta * (kl - logratio)))
        reward = jax.lax.stop_gradient(cfg.beta * logratio)
        chosen = label > 0
        return {"loss": jnp.where(chosen, desirable, undesirable), "reward": reward,
                "correct": jnp.where(chosen, reward > 0, reward < 0).astype(reward.dtype)}

    @staticmethod
    def _summaries(model: Any, out: Dict[str, jax.Array], *, policy: jax.Array,
                   label: jax.Array, example: jax.Array, kl: jax.Array,
                   batch_axes: Tuple[str, ...]) -> None:
        """TRL's metrics over the whole batch: each label's sums over its examples' count (0
        where the batch has none of that label), the same on every device."""
        desirable, undesirable = example * label, example * (1.0 - label)
        policy = jax.lax.stop_gradient(policy)
        metrics = {"kl": kl}
        for name, mask in (("chosen", desirable), ("rejected", undesirable)):
            metrics[f"rewards/{name}"] = batch_mean(out["reward"] * mask, mask, batch_axes)
            metrics[f"logps/{name}"] = batch_mean(policy * mask, mask, batch_axes)
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        for name, value in metrics.items():
            model.add_summary(f"{OBJECTIVE_METRICS}/{name}", value)

    def describe(self) -> Optional[str]:
        cfg = self.config
        return (f"objective: KTO (beta {cfg.beta}, desirable x{cfg.desirable_weight}, "
                f"undesirable x{cfg.undesirable_weight}); reference: "
                f"{self.reference.describe()}")

