"""GRPO and its 2025 variants as one objective (``--config.grpo``): what a rollout samples, how
its rewards become advantages and how the policy learns from them.

``loss`` picks the variant, each as its authors (and TRL) define it; fields left None take the
variant's own default:

==========  ===============  ============  ===========  =================  ===================
loss        importance       aggregation   eps low/high  scale_rewards      drop_equal_groups
==========  ===============  ============  ===========  =================  ===================
grpo        per token        row means     0.2 / 0.2     group              no
dr_grpo     per token        token sum     0.2 / 0.2     none               no
dapo        per token        token mean    0.2 / 0.28    group              yes
gspo        per sequence     row means     3e-4 / 4e-4   group              no
==========  ===============  ============  ===========  =================  ===================

(``policy_loss.py`` has the formulas, ``advantages.py`` the normalisation.) DAPO's dynamic
sampling here drops the groups whose rewards are all equal (they carry no signal) from the loss
and its token count; it does not sample more prompts to refill the batch. ``beta > 0`` adds
the k3 KL estimate to a reference: the starting weights (a frozen copy), or with LoRA the
base with its adapters off.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Literal, Optional, Sequence

import jax

from titanax.config import Configurable
from titanax.rl import policy_loss as policy_loss_lib
from titanax.rl.advantages import SCALES
from titanax.rl.rewards import Reward

LOSSES = ("grpo", "dr_grpo", "dapo", "gspo")
# Per variant: (aggregation, sequence-level ratio, eps low, eps high, scale_rewards, drop).
VARIANTS = {"grpo": ("grpo", False, 0.2, 0.2, "group", False),
            "dr_grpo": ("dr_grpo", False, 0.2, 0.2, "none", False),
            "dapo": ("dapo", False, 0.2, 0.28, "group", True),
            "gspo": ("grpo", True, 3e-4, 4e-4, "group", False)}


class GRPO(Configurable):
    """Rollouts, rewards and the policy loss of an RL run (see the module docstring)."""

    class Config(Configurable.Config):
        # grpo | dr_grpo | dapo | gspo (the table of the module docstring).
        loss: Literal["grpo", "dr_grpo", "dapo", "gspo"] = "grpo"
        # Completions sampled per prompt (a group; its rows share one batch shard).
        num_generations: int = 8
        # Tokens sampled per completion (its budget; Dr. GRPO's max_completion_length).
        max_new_tokens: int = 64
        # Sampling temperature; the trained log-probs divide the logits by it too.
        temperature: float = 1.0
        # Nucleus sampling (1: the whole distribution).
        top_p: float = 1.0
        # Optimizer steps on each rollout batch, split into as many equal parts (TRL's
        # steps_per_generation); the rollout's own log-probs are the old policy of the ratio.
        updates_per_rollout: int = 1
        # Passes over each rollout's updates (GRPO's mu, TRL's num_iterations).
        iterations: int = 1
        # Clipping of the importance ratio: [1 - epsilon_low, 1 + epsilon_high] (None: the
        # variant's).
        epsilon_low: Optional[float] = None
        epsilon_high: Optional[float] = None
        # Weight of the KL (k3) to the reference; 0: none (no reference is held).
        beta: float = 0.0
        # The KL estimate weighed by the importance ratio (the tokens are the old policy's
        # samples; TRL's use_bias_correction_kl).
        kl_importance_correction: bool = True
        # Advantages divided by the std of the "group", the "batch", or "none" (None: the
        # variant's).
        scale_rewards: Optional[Literal["group", "batch", "none"]] = None
        # Groups whose rewards are all equal leave the loss (None: the variant's; DAPO's).
        drop_equal_groups: Optional[bool] = None
        # Your reward functions by import path (``package.module.function`` or
        # ``package.module:function``), called as TRL calls them: ``fn(prompts=...,
        # completions=..., completion_ids=..., **the prompt record's other fields)`` -> one
        # float per completion (None: abstains).
        reward_functions: Sequence[str] = ()
        # Their weights, in order (None: 1 each).
        reward_weights: Optional[Sequence[float]] = None
        # Built-in rewards (rl/rewards.py: AnswerMatch, FormatMatch, LengthPenalty), by the
        # name their metrics carry.
        rewards: Dict[str, Reward.Config] = {}
        # Token ids that end a completion (it is scored and trained up to and including the
        # first); None: the tokenizer's end-of-sequence (and a chat template's end of turn).
        end_ids: Optional[Sequence[int]] = None

        def _validate_values(self):
            if self.loss not in LOSSES:
                yield "loss", f"must be one of {', '.join(LOSSES)}, got {self.loss!r}"
            if self.num_generations < 2:
                yield "num_generations", (f"must be >= 2 (advantages compare a prompt's "
                                          f"completions), got {self.num_generations}")
            if self.max_new_tokens < 1:
                yield "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}"
            if not (math.isfinite(self.temperature) and self.temperature > 0):
                yield "temperature", f"must be > 0 (RL samples), got {self.temperature}"
            if not 0 < self.top_p <= 1:
                yield "top_p", f"must be in (0, 1], got {self.top_p}"
            if self.updates_per_rollout < 1:
                yield "updates_per_rollout", f"must be >= 1, got {self.updates_per_rollout}"
            if self.iterations < 1:
                yield "iterations", f"must be >= 1, got {self.iterations}"
            for name in ("epsilon_low", "epsilon_high"):
                value = getattr(self, name)
                if value is not None and not (math.isfinite(value) and value >= 0):
                    yield name, f"must be a finite number >= 0 (or None), got {value}"
            if self.epsilon_low is not None and self.epsilon_low >= 1:
                yield "epsilon_low", f"must be < 1 (the ratio's floor 1 - it), got " \
                                     f"{self.epsilon_low}"
            if not (math.isfinite(self.beta) and self.beta >= 0):
                yield "beta", f"must be a finite number >= 0, got {self.beta}"
            if self.scale_rewards is not None and self.scale_rewards not in SCALES:
                yield "scale_rewards", f"must be one of {', '.join(SCALES)}, got " \
                                       f"{self.scale_rewards!r}"
            if self.reward_weights is not None and not all(
                    isinstance(w, (int, float)) and math.isfinite(w)
                    for w in self.reward_weights):
                yield "reward_weights", f"must be finite numbers, got {list(self.reward_weights)}"
            if self.reward_weights is not None and \
                    len(self.reward_weights) != len(self.reward_functions):
                yield "reward_weights", (f"has {len(self.reward_weights)} weights for "
                                         f"{len(self.reward_functions)} reward_functions")
            if self.end_ids is not None and not self.end_ids:
                yield "end_ids", "is empty: give the ids that end a completion (or None)"
            if not self.reward_functions and not self.rewards:
                yield "reward_functions", "no reward: name a function (or a built-in in rewards)"

    # The model method the gradient computer calls with this objective.
    model_method = "policy_gradient_forward"
    # Batch fields kept in float32 under a lower compute precision (gradients.compute_inputs):
    # the rollout's log-probs, advantages and weights enter the ratio and the loss exactly.
    exact_fields = ("old_logps", "advantages", "row_weights", "weights")

    def _variant(self, index: int) -> Any:
        return VARIANTS[self.config.loss][index]

    @property
    def needs_reference(self) -> bool:
        return self.config.beta > 0

    @property
    def temperature(self) -> float:
        return self.config.temperature

    @property
    def epsilons(self):
        cfg = self.config
        low = cfg.epsilon_low if cfg.epsilon_low is not None else self._variant(2)
        high = cfg.epsilon_high if cfg.epsilon_high is not None else (
            self._variant(3) if cfg.epsilon_low is None else low)
        return low, high

    @property
    def scale_rewards(self) -> str:
        return self.config.scale_rewards or self._variant(4)

    @property
    def drop_equal_groups(self) -> bool:
        cfg = self.config
        return cfg.drop_equal_groups if cfg.drop_equal_groups is not None else self._variant(5)

    def loss(self, *, logps: jax.Array, old_logps: jax.Array, advantages: jax.Array,
             mask: jax.Array, ref_logps: Optional[jax.Array] = None,
             row_weights: Optional[jax.Array] = None) -> policy_loss_lib.PolicyLoss:
        """The variant's loss on ``[rows, tokens]`` log-probs (``policy_loss.policy_loss``)."""
        low, high = self.epsilons
        return policy_loss_lib.policy_loss(
            logps=logps, old_logps=old_logps, advantages=advantages, mask=mask,
            aggregation=self._variant(0), sequence_level=self._variant(1), epsilon_low=low,
            epsilon_high=high, beta=self.config.beta, ref_logps=ref_logps,
            kl_importance_correction=self.config.kl_importance_correction,
            max_completion_length=self.config.max_new_tokens, row_weights=row_weights)
