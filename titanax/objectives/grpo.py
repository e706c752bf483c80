"""GRPO and its 2025 variants as one objective (``--config.objective.*`` of ``llama_tiny_grpo``):
what a rollout samples (``sampling.py``), how its rewards become advantages and how the policy
learns from them.

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

from titanax import errors
from titanax.modules.layers.moe import add_moe_objective
from titanax.modules.models.language_model import document_inputs
from titanax.modules.module import functional
from titanax.objectives import frozen
from titanax.objectives.sampling import SamplingObjective
from titanax.rl import policy_loss as policy_loss_lib
from titanax.rl.advantages import SCALES
from titanax.rl.rewards import Reward, RewardSet
from titanax.train.objective import OBJECTIVE_METRICS

LOSSES = ("grpo", "dr_grpo", "dapo", "gspo")
# Per variant: (aggregation, sequence-level ratio, eps low, eps high, scale_rewards, drop).
VARIANTS = {"grpo": ("grpo", False, 0.2, 0.2, "group", False),
            "dr_grpo": ("dr_grpo", False, 0.2, 0.2, "none", False),
            "dapo": ("dapo", False, 0.2, 0.28, "group", True),
            "gspo": ("grpo", True, 3e-4, 4e-4, "group", False)}
# The params key of the frozen reference model (the KL's, beta > 0).
REFERENCE = "reference"


class GRPO(SamplingObjective):
    """Rollouts, rewards and the policy loss of an RL run (see the module docstring)."""

    # Its loss is ~0 at each rollout's first update (the advantages' mean): the rewards say more.
    console_columns = ("reward", "reward_std", "kl", "completions/mean_length", "entropy")

    class Config(SamplingObjective.Config):
        # grpo | dr_grpo | dapo | gspo (the table of the module docstring).
        loss: Literal["grpo", "dr_grpo", "dapo", "gspo"] = "grpo"
        # Clipping of the importance ratio: [1 - epsilon_low, 1 + epsilon_high] (None: the
        # variant's).
        epsilon_low: Optional[float] = None
        epsilon_high: Optional[float] = None
        # Weight of the KL (k3) to the reference; 0: none (no reference is held).
        beta: float = 0.0
        # The KL estimate weighed by the importance ratio (the tokens are the old policy's
        # samples; TRL's use_bias_correction_kl).
        kl_importance_correction: bool = True
        # A Hugging Face directory of the KL's reference model (same architecture); None: the
        # starting weights (with LoRA: the base, its adapters off -- no second copy).
        reference_from: Optional[str] = None
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
        # Rollouts sampled ahead of the one trained on, each with the params of when it
        # started (asynchronous GRPO: rollout n+1 sampled while rollout n's steps train;
        # rl/rollouts_ahead.py); 0: on-policy.
        max_staleness: int = 0
        # With max_staleness > 0, how the loss treats tokens sampled by older params:
        # "ratio": the clipped ratio to the sampler's log-probs, as on-policy (PPO's own
        # correction, exact: the sampler's log-probs are the trainer's); "truncated": the
        # ratio to the policy at its update, each token's loss weighed by min(p_policy /
        # p_sampler, importance_cap) (TRL's vllm_importance_sampling_correction, verl's TIS:
        # for samplers whose log-probs are not the trainer's); "off": the ratio to the policy
        # at its update, no weight (the correction removed).
        importance_correction: Literal["ratio", "truncated", "off"] = "ratio"
        # The importance weight's cap.
        importance_cap: float = 2.0

        def _validate_values(self):
            yield from super()._validate_values()
            if self.loss not in LOSSES:
                yield "loss", f"must be one of {', '.join(LOSSES)}, got {self.loss!r}"
            if self.num_generations < 2:
                yield "num_generations", (f"must be >= 2 (advantages compare a prompt's "
                                          f"completions), got {self.num_generations}")
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
            else:
                yield from self._problems_if_all_rewards_weigh_zero()
            if self.reward_weights is not None and \
                    len(self.reward_weights) != len(self.reward_functions):
                yield "reward_weights", (f"has {len(self.reward_weights)} weights for "
                                         f"{len(self.reward_functions)} reward_functions")
            if self.max_staleness < 0:
                yield "max_staleness", f"must be >= 0 (0: on-policy), got {self.max_staleness}"
            if not (math.isfinite(self.importance_cap) and self.importance_cap >= 1):
                yield "importance_cap", f"must be a finite number >= 1, got " \
                                        f"{self.importance_cap}"
            if self.max_staleness > 0 and self.importance_correction != "ratio" and \
                    self.iterations > 1:
                yield "iterations", (
                    f"must be 1 with max_staleness {self.max_staleness} and the "
                    f"{self.importance_correction!r} correction (its ratio is to the policy at "
                    f"the rows' first update), got {self.iterations}")
            if not self.reward_functions and not self.rewards:
                yield "reward_functions", "no reward: name a function (or a built-in in rewards)"

        def _problems_if_all_rewards_weigh_zero(self):
            """Every reward weighted 0 sums to 0 for every completion: nothing to learn."""
            weights = list(self.reward_weights) if self.reward_weights is not None else \
                [1.0] * len(self.reward_functions)
            built_in = [getattr(r, "weight", 1.0) for r in self.rewards.values()]
            if (weights or built_in) and not any(w != 0 for w in weights + built_in):
                path = "reward_weights" if weights else \
                    f"rewards[{next(iter(self.rewards))!r}].weight"
                yield path, (f"every reward is weighted 0 (reward_weights {weights}, built-in "
                             f"rewards' weights {built_in}): the summed reward is 0 for every "
                             f"completion and nothing is learned")

    def __init__(self, cfg=None, **fields):
        super().__init__(cfg, **fields)
        self.reference = frozen.FrozenModel(key=REFERENCE, directory=self.config.reference_from,
                                            path="objective.reference_from",
                                            what="reference model")
        self.rewards: Optional[RewardSet] = None

    def _variant(self, index: int) -> Any:
        return VARIANTS[self.config.loss][index]

    @property
    def needs_reference(self) -> bool:
        return self.config.beta > 0

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

    # --- At build ------------------------------------------------------------------------------

    def check(self, run: Any) -> None:
        cfg = self.config
        # (Imported first: a typo in a reward's path stops the build before anything else.)
        self.rewards = self.reward_set()
        if cfg.reference_from is not None and not self.needs_reference:
            raise errors.ConfigError(
                "names the reference of GRPO's KL, and this run has none (beta 0)",
                path="objective.reference_from",
                suggestion="set objective.beta > 0, or drop reference_from")
        if cfg.max_staleness > 0 and jax.process_count() > 1:
            raise errors.ConfigError(
                f"samples rollouts ahead, and this run has {jax.process_count()} processes: "
                "a checkpoint keeps the rollouts sampled ahead in its data state, which holds "
                "one process's rows", path="objective.max_staleness",
                suggestion="train on one process, or on-policy (max_staleness=0)")
        super().check(run)
        self.reference.setup(run, needed=self.needs_reference)

    def reward_set(self) -> Optional[RewardSet]:
        """The rewards that score each rollout (None: the batches score themselves)."""
        cfg = self.config
        return RewardSet(functions=cfg.reward_functions, weights=cfg.reward_weights,
                         rewards=cfg.rewards)

    def frozen_models(self):
        return (self.reference,)

    # --- The loss ------------------------------------------------------------------------------

    def loss(self, model, params, batch, *, key, is_training, batch_axes=()):
        return functional(model, key, params, (batch,), method=self._policy_loss,
                          is_training=is_training)

    def _policy_loss(self, model: Any, batch: Dict[str, jax.Array]):
        """Runs as a method of ``model``: the variant's policy loss on rollout rows
        (rl/rows.py), the log-probs of the logits divided by the sampling temperature; the
        reference's (KL) from the frozen model. Returns ``(loss, aux)`` with the count the
        loss is a mean over (``num_examples`` or ``num_tokens``) and ``loss_sum``; summaries
        ``metrics/kl`` and ``metrics/clip_ratio/*`` (token means)."""
        row_inputs = dict(document_inputs(batch), input_ids=batch["input_ids"],
                          target_ids=batch["target_ids"], temperature=self.temperature)
        logps = model.token_logps(**row_inputs)
        reference = None
        if self.needs_reference:
            reference = self.reference.call(model, method="token_logps", inputs=row_inputs)
        exact = {name: batch[name].astype(logps.dtype)  # (float32, or float64 in such runs)
                 for name in ("old_logps", "advantages", "weights", "row_weights")}
        out = self.policy_loss(logps=logps, old_logps=exact["old_logps"],
                               advantages=exact["advantages"], mask=exact["weights"],
                               ref_logps=reference, row_weights=exact["row_weights"])
        for name, value in out.stats.items():
            model.add_summary(f"{OBJECTIVE_METRICS}/{name}", value)
        loss = add_moe_objective(out.loss, model.collected_outputs())
        return loss, {"loss_sum": out.loss * out.count, out.count_name: out.count}

    def policy_loss(self, *, logps: jax.Array, old_logps: jax.Array, advantages: jax.Array,
                    mask: jax.Array, ref_logps: Optional[jax.Array] = None,
                    row_weights: Optional[jax.Array] = None) -> policy_loss_lib.PolicyLoss:
        """The variant's loss on ``[rows, tokens]`` log-probs (``policy_loss.policy_loss``);
        ``old_logps``: the sampler's (corrected as ``importance_correction`` says when the
        rollouts are sampled ahead)."""
        low, high = self.epsilons
        cfg = self.config
        stale = cfg.max_staleness > 0 and cfg.importance_correction != "ratio"
        return policy_loss_lib.policy_loss(
            logps=logps, old_logps=old_logps, advantages=advantages, mask=mask,
            aggregation=self._variant(0), sequence_level=self._variant(1), epsilon_low=low,
            epsilon_high=high, beta=self.config.beta, ref_logps=ref_logps,
            stale_correction=cfg.importance_correction if stale else None,
            importance_cap=cfg.importance_cap,
            kl_importance_correction=self.config.kl_importance_correction,
            max_completion_length=self.completion_budget, row_weights=row_weights)

    @property
    def completion_budget(self) -> int:
        """The tokens a row's completion may hold (Dr. GRPO's max_completion_length)."""
        return self.config.max_new_tokens

    def describe(self) -> Optional[str]:
        cfg = self.config
        low, high = self.epsilons
        reference = ("none (beta 0)" if not self.needs_reference
                     else self.reference.describe())
        return (f"objective: {cfg.loss} ({cfg.num_generations} completions per prompt of up to "
                f"{cfg.max_new_tokens} tokens, temperature {cfg.temperature}; clip [{1 - low:g}, "
                f"{1 + high:g}], beta {cfg.beta}; reference: {reference}; rewards: "
                f"{', '.join(self.rewards.names) if self.rewards else '?'}"
                f"{self._staleness()})")

    def _staleness(self) -> str:
        cfg = self.config
        if not cfg.max_staleness:
            return ""
        correction = {"ratio": "the clipped ratio to the sampler",
                      "truncated": f"truncated importance weights, cap {cfg.importance_cap:g}",
                      "off": "uncorrected"}[cfg.importance_correction]
        return f"; rollouts up to {cfg.max_staleness} behind, {correction}"
