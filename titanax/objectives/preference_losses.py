"""Preference losses: how a policy's log-probs of a chosen and a rejected completion (and a
reference model's) become a loss per pair -- DPO (``sigmoid``), IPO, ``hinge``, SimPO, ORPO.

Inputs per pair: the summed log-probs of each completion's tokens under the policy (``pc``,
``pr``) and the reference (``rc``, ``rr``; the reference-free losses take none), and each
completion's token count (``nc``, ``nr``). With ``beta``:

- ``sigmoid`` (DPO): ``-log sigmoid(beta * ((pc - rc) - (pr - rr)))``;
- ``hinge``: ``relu(1 - beta * ((pc - rc) - (pr - rr)))``;
- ``ipo``: ``((pc - rc) / nc - (pr - rr) / nr - 1 / (2 beta))^2`` -- the log-ratios per
  completion token, as TRL's IPO (its authors' normalisation);
- ``simpo`` (reference-free): ``-log sigmoid(beta * (pc / nc - pr / nr) - simpo_gamma)``, the
  log-probs per token and a target margin ``simpo_gamma`` (TRL's ``simpo_gamma / beta`` inside);
- ``orpo`` (reference-free): the chosen completions' NLL (the mean over their tokens) plus
  ``-beta * log sigmoid(log odds(chosen) - log odds(rejected))``, each completion's odds from its
  per-token log-prob ``l``: ``log odds = l - log(1 - exp(l))``.

The rewards TRL logs: ``beta * (p - r)`` with a reference, ``beta * p / n`` without. Numbers in
float32 (or wider).
"""

from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp


LOSSES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")


class PairLosses(NamedTuple):
    """Per pair: the loss (ORPO's without its NLL term, which is a mean over tokens, not pairs),
    and the rewards of the chosen and the rejected completion."""

    loss: jax.Array
    chosen_rewards: jax.Array
    rejected_rewards: jax.Array


REFERENCE_FREE = ("simpo", "orpo")


def pair_losses(*, loss: str, beta: float, simpo_gamma: float, policy: Dict[str, jax.Array],
                reference: Optional[Dict[str, jax.Array]],
                tokens: Dict[str, jax.Array]) -> PairLosses:
    """``loss``'s per-pair loss and rewards. ``policy`` / ``reference``: ``{"chosen": [pairs],
    "rejected": [pairs]}`` summed log-probs (``reference`` None for the reference-free
    losses); ``tokens``: the completions' token counts, alike."""
    pc, pr = policy["chosen"], policy["rejected"]
    nc, nr = (jnp.maximum(tokens[s], 1.0) for s in ("chosen", "rejected"))
    if loss not in REFERENCE_FREE:
        chosen_ratio, rejected_ratio = pc - reference["chosen"], pr - reference["rejected"]
        margin = chosen_ratio - rejected_ratio
        if loss == "sigmoid":
            per_pair = -jax.nn.log_sigmoid(beta * margin)
        elif loss == "hinge":
            per_pair = jax.nn.relu(1.0 - beta * margin)
        else:  # ipo
            per_pair = (chosen_ratio / nc - rejected_ratio / nr - 1.0 / (2.0 * beta)) ** 2
        rewards = (beta * chosen_ratio, beta * rejected_ratio)
    else:
        chosen_mean, rejected_mean = pc / nc, pr / nr
        if loss == "simpo":
            per_pair = -jax.nn.log_sigmoid(beta * (chosen_mean - rejected_mean) - simpo_gamma)
        else:  # orpo
            log_odds = ((chosen_mean - rejected_mean)
                        - (_log1mexp(chosen_mean) - _log1mexp(rejected_mean)))
            per_pair = -beta * jax.nn.log_sigmoid(log_odds)
        rewards = (beta * chosen_mean, beta * rejected_mean)
    return PairLosses(per_pair, *(jax.lax.stop_gradient(r) for r in rewards))


def _log1mexp(x: jax.Array) -> jax.Array:
    """``log(1 - exp(x))`` for ``x < 0``, accurate near 0 and far below it. Each branch sees
    only inputs it is finite at (``where`` differentiates both), and ``x`` stays below 0 by the
    smallest step: a completion the policy is sure of (mean log-prob -1e-8) gives a finite
    gradient, not NaN."""
    x = jnp.minimum(x, -jnp.finfo(x.dtype).tiny)
    near = x > -math.log(2.0)
    return jnp.where(near, jnp.log(-jnp.expm1(jnp.where(near, x, -1.0))),
                     jnp.log1p(-jnp.exp(jnp.where(near, -1.0, x))))
