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
                row_weights: Optional[jax.Array] = None) -> PolicyLoss:
    """``logps`` / ``old_logps`` / ``ref_logps`` / ``mask``: ``[rows, tokens]`` (``mask``: 1 at
    the completion's tokens); ``advantages`` / ``row_weights``: ``[rows]``."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    rows = logps.shape[0]
    weights = jnp.ones((rows,), logps.dtype) if row_weights is None else row_weights
    mask = mask.astype(logps.dtype) * weights[:, None]
    tokens_per_row = jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
    log_ratio = logps - old_logps
    if sequence_level:
        log_ratio = (jnp.sum(log_ratio * mask, axis=-1) / tokens_per_row)[:, None]
    coef = jnp.exp(log_ratio)
    clipped = jnp.clip(coef, 1.0 - epsilon_low, 1.0 + epsilon_high)
    a = advantages[:, None].astype(logps.dtype)
    per_token = -jnp.minimum(coef * a, clipped * a)
    kl = None
    if beta:
        # (0 where masked: exp of a far-off padding position's difference could overflow.)
        delta = jnp.where(mask > 0, ref_logps - logps, 0.0)
        kl = jnp.exp(delta) - delta - 1.0
        if kl_importance_correction:  # The samples are the old policy's: weigh them by w.
            kl = kl * coef
        per_token = per_token + beta * kl
    per_token = jnp.broadcast_to(per_token, mask.shape)
    if aggregation == "grpo":
        count, count_name = jnp.sum(weights), "num_examples"
        per_row = jnp.sum(per_token * mask, axis=-1) / tokens_per_row
        loss = jnp.sum(per_row * weights) / jnp.maximum(count, 1.0)
    elif aggregation == "dr_grpo":
        count, count_name = jnp.sum(weights), "num_examples"
        loss = jnp.sum(per_token * mask) / (jnp.maximum(count, 1.0) * max_completion_length)
    else:
        count, count_name = jnp.sum(mask), "num_tokens"
        loss = jnp.sum(per_token * mask) / jnp.maximum(count, 1.0)
    def token_mean(values):  # (Sequence level: one value per row, a mean over the rows.)
        if values.shape[1] == 1:
            return jnp.sum(values[:, 0] * weights) / jnp.maximum(jnp.sum(weights), 1.0)
        return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    low = (coef < 1.0 - epsilon_low) & (a < 0)
    high = (coef > 1.0 + epsilon_high) & (a > 0)
    stats = {"sampling/logp_difference/mean": token_mean(jnp.abs(logps - old_logps)),
             "clip_ratio/low_mean": token_mean(low.astype(logps.dtype)),
             "clip_ratio/high_mean": token_mean(high.astype(logps.dtype)),
             "clip_ratio/region_mean": token_mean((low | high).astype(logps.dtype))}
    if kl is not None:
        stats["kl"] = token_mean(kl)
    return PolicyLoss(loss=loss, count=count, count_name=count_name,
                      stats={k: jax.lax.stop_gradient(v) for k, v in stats.items()})
