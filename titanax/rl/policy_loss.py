"""The clipped policy-gradient loss of GRPO and its variants, per token, from log-probs.

Per completion token ``t`` of row ``i``: the log-ratio ``r = logp - old_logp`` of the policy
being trained to the one that sampled (the rollout's log-probs); its importance weight ``w =
exp(r)`` per token, or (GSPO, ``sequence_level``) ``exp(mean of r over the row's completion)``
for every token of the row; the clipped surrogate ``-min(w A, clip(w, 1 - eps_low, 1 +
eps_high) A)`` with the row's advantage ``A``; plus ``beta x`` the k3 estimate of KL(policy ||
reference), ``exp(ref - logp) - (ref - logp) - 1`` -- times ``w`` (``kl_importance_correction``,
TRL's ``use_bias_correction_kl``: the tokens were sampled by the old policy). The per-token losses are then aggregated:

- ``grpo`` (and GSPO): each row's mean over its completion tokens, then the mean over rows;
- ``dr_grpo``: the sum over every completion token / (rows x ``max_completion_length``);
- ``dapo``: the sum over every completion token / their number (a token-level mean).

These are TRL's ``GRPOTrainer._compute_loss`` formulas (``loss_type`` grpo / dr_grpo / dapo,
``importance_sampling_level`` token / sequence); ``tests/hf/test_grpo_parity.py`` holds the two
to each other. A row's ``row_weights`` (0: padding, or a group dynamic sampling dropped) takes it
out of the loss and out of its count. Float32 or wider.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp

AGGREGATIONS = ("grpo", "dr_grpo", "dapo")


class PolicyLoss(NamedTuple):
    """The loss, what it is a mean over (``count``: rows or tokens, ``count_name`` says which:
    the gradient computer weighs data shards by it) and its statistics (token means)."""

    loss: jax.Array
    count: jax.Array
    count_name: str
    stats: Dict[str, jax.Array]


def policy_loss(*, logps: jax.Array, old_logps: jax.Array, advantages: jax.Array,
                mask: jax.Array, aggregation: str, epsilon_low: float, epsilon_high: float,
                sequence_level: bool = False, beta: float = 0.0,
                ref_logps: Optional[jax.Array] = None, kl_importance_correction: bool = True,
                max_completion_length: int = 1,
                row_weights: Optional[jax.Array] = None,
                stale_correction: Optional[str] = None,
                importance_cap: float = 2.0) -> PolicyLoss:
    """``logps`` / ``old_logps`` / ``ref_logps`` / ``mask``: ``[rows, tokens]`` (``mask``: 1 at
    the completion's tokens); ``advantages`` / ``row_weights``: ``[rows]``.

    ``old_logps`` are the sampler's. ``stale_correction`` (rollouts sampled by older params:
    asynchronous GRPO) replaces the ratio to them: ``"truncated"`` takes the ratio to the policy
    as it is at this update (the rows' first) and weighs every token's policy term (not its KL)
    by its truncated importance weight to the sampler, ``min(exp(logp - old_logp),
    importance_cap)`` (no gradient through it) -- TRL's ``vllm_importance_sampling_correction``,
    verl's TIS; ``"off"`` takes the ratio to the policy at this update and no weight (the stale
    tokens treated as the policy's own: the correction removed). None: the ratio to
    ``old_logps``, clipped -- PPO's own correction, exact where the sampler's log-probs are the
    trainer's."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    rows = logps.shape[0]
    weights = jnp.ones((rows,), logps.dtype) if row_weights is None else row_weights
    mask = mask.astype(logps.dtype) * weights[:, None]
    tokens_per_row = jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
    importance, sampler_logps = None, old_logps
    if stale_correction is not None:
        old_logps = jax.lax.stop_gradient(logps)
    if stale_correction == "truncated":
        # (0 where masked: a padding place's difference could overflow exp.)
        importance = jnp.minimum(jnp.exp(jnp.where(mask > 0, old_logps - sampler_logps, 0.0)),
                                 importance_cap)
    log_ratio = logps - old_logps
    if sequence_level:
        log_ratio = (jnp.sum(log_ratio * mask, axis=-1) / tokens_per_row)[:, None]
    coef = jnp.exp(log_ratio)
    clipped = jnp.clip(coef, 1.0 - epsilon_low, 1.0 + epsilon_high)
    a = advantages[:, None].astype(logps.dtype)
    per_token = -jnp.minimum(coef * a, clipped * a)
    if importance is not None:  # (The policy term only, as TRL: not the KL.)
        per_token = per_token * importance
    kl = None
    if beta:
        # (0 where masked: exp of a far-off padding position's difference could overflow.)
        delta = jnp.where(mask > 0, ref_logps - logps, 0.0)
        kl = jnp.exp(delta) - delta - 1.0
        if kl_importance_correction:  # The samples are the old policy's: weigh them by w.
            kl = kl * coef
        per_token = per_token + beta * kl
    per_token = jnp.broadcast_to(per_token, mask.shape)
    loss, count, count_name = _aggregate(per_token, mask=mask, weights=weights,
                                         aggregation=aggregation,
                                         max_completion_length=max_completion_length)
    stats = _stats(logps=logps, sampled_by=sampler_logps, coef=coef, advantages=a, mask=mask,
                   weights=weights, epsilons=(epsilon_low, epsilon_high), kl=kl,
                   importance=importance, importance_cap=importance_cap)
    return PolicyLoss(loss=loss, count=count, count_name=count_name,
                      stats={k: jax.lax.stop_gradient(v) for k, v in stats.items()})


def _stats(*, logps, sampled_by, coef, advantages, mask, weights, epsilons, kl, importance,
           importance_cap) -> Dict[str, jax.Array]:
    """Token means: the log-probs' distance to the sampler's, the clipped fractions, the KL
    and the importance weights (where there are)."""
    def token_mean(values):  # (Sequence level: one value per row, a mean over the rows.)
        if values.shape[1] == 1:
            return jnp.sum(values[:, 0] * weights) / jnp.maximum(jnp.sum(weights), 1.0)
        return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    low = (coef < 1.0 - epsilons[0]) & (advantages < 0)
    high = (coef > 1.0 + epsilons[1]) & (advantages > 0)
    stats = {"sampling/logp_difference/mean": token_mean(jnp.abs(logps - sampled_by)),
             "clip_ratio/low_mean": token_mean(low.astype(logps.dtype)),
             "clip_ratio/high_mean": token_mean(high.astype(logps.dtype)),
             "clip_ratio/region_mean": token_mean((low | high).astype(logps.dtype))}
    if kl is not None:
        stats["kl"] = token_mean(kl)
    if importance is not None:
        stats["sampling/importance_weight/mean"] = token_mean(importance)
        stats["sampling/importance_weight/capped"] = token_mean(
            (importance >= importance_cap).astype(logps.dtype))
    return stats


def _aggregate(per_token: jax.Array, *, mask: jax.Array, weights: jax.Array, aggregation: str,
               max_completion_length: int):
    """``(loss, count, count_name)``: the per-token losses aggregated as the module docstring
    says."""
    tokens_per_row = jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
    if aggregation == "grpo":
        count, count_name = jnp.sum(weights), "num_examples"
        per_row = jnp.sum(per_token * mask, axis=-1) / tokens_per_row
        return jnp.sum(per_row * weights) / jnp.maximum(count, 1.0), count, count_name
    if aggregation == "dr_grpo":
        count, count_name = jnp.sum(weights), "num_examples"
        return (jnp.sum(per_token * mask) / (jnp.maximum(count, 1.0) * max_completion_length),
                count, count_name)
    count, count_name = jnp.sum(mask), "num_tokens"
    return jnp.sum(per_token * mask) / jnp.maximum(count, 1.0), count, count_name
