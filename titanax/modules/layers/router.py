"""The router of a mixture-of-experts layer: which ``top_k`` experts each token goes to, and how
much of each expert's output it keeps.

Two scoring rules cover today's models:

* ``"softmax"`` (Mixtral, Qwen 3 MoE, GPT-OSS): the gates are the softmax probabilities of the
  chosen experts, renormalised over the ``top_k`` when ``normalize_top_k`` (Mixtral always, Qwen
  by ``norm_topk_prob``);
* ``"sigmoid"`` (DeepSeek-V3): each expert's score is ``sigmoid(logit)``, the chosen scores are
  normalised to sum to 1 and scaled by ``routed_scaling``.

**Aux-loss-free balancing** (DeepSeek-V3, Wang et al. 2024): with ``balance_rate > 0`` the router
keeps a per-expert ``expert_bias``, added to the scores *for choosing only* (the gates never see
it). After each training call it moves towards balance by ``balance_rate`` times each expert's
shortfall against the mean load, ``1 - assignments_i / mean`` (up for the under-loaded, down for
the over-loaded). It is a state update (``add_state_update``), averaged over the data shards and
microbatches like every other; being linear in the loads, the average is the update the whole
batch's loads give, on any mesh whose shards hold as many real tokens each (a mean of the shards'
steps weighs each shard alike: with padding spread unevenly it is not the whole batch's step --
as the balancing loss and the load metrics, averaged over shards the same way). (DeepSeek-V3
moves by the sign of the shortfall, counted over the whole batch; a sign per shard, averaged,
would be a noisy vote instead.)

The logits are computed in float32 whatever the compute dtype: a top-k choice flips on rounding.

Padding tokens (segment id 0 in packed rows) are not routed: their gates are 0, and no count,
load, loss or bias step sees them (Hugging Face's balancing loss masks them the same way).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import jax
import jax.numpy as jnp

from titanax.modules.base_layer import BaseLayer, ParameterSpec, constant
from titanax.modules.initializers import FanAxes
from titanax.utils.dtypes import at_least_float32


@dataclasses.dataclass(frozen=True)
class Routing:
    """One call's routing of ``T`` tokens (local view)."""

    # [T, top_k] int32: the chosen experts, best first.
    expert_ids: jax.Array
    # [T, top_k] float32: the weight of each chosen expert's output.
    gates: jax.Array
    # [T, num_experts] float32: the router's logits (for the z-loss).
    logits: jax.Array
    # [T, num_experts] float32: each token's distribution over the experts (softmax, or the
    # normalised sigmoid scores): the P of the load-balancing loss.
    probabilities: jax.Array
    # [T] float32: 1 for a token that is routed, 0 for padding (segment id 0), whose gates are
    # 0 and which no count, load or loss sees.
    valid: jax.Array
    # [num_experts] float32: the real tokens' assignments to each expert (``assignment_counts``,
    # counted once for the bias step, the loads and the balancing loss).
    counts: jax.Array


class Router(BaseLayer):
    """``tokens [T, model_dim] -> Routing``."""

    class Config(BaseLayer.Config):
        # Input width, experts to choose from and experts per token: the MoE layer's (it sets
        # them; None only before it has).
        model_dim: Optional[int] = None
        num_experts: Optional[int] = None
        top_k: Optional[int] = None
        # "softmax" (Mixtral, Qwen 3 MoE) or "sigmoid" (DeepSeek-V3): see the module docstring.
        scoring: Literal["softmax", "sigmoid"] = "softmax"
        # Renormalise the chosen experts' gates to sum to 1 (HF norm_topk_prob; Mixtral: True).
        # The sigmoid rule always normalises.
        normalize_top_k: bool = True
        # The gates are multiplied by this (DeepSeek-V3's routed_scaling_factor).
        routed_scaling: float = 1.0
        # Aux-loss-free balancing: the expert bias moves by this much per training step (0: it
        # does not move -- no bias unless choosing_bias; DeepSeek-V3 uses 0.001).
        balance_rate: float = 0.0
        # Keep the expert bias without moving it (balance_rate 0): DeepSeek-V3's
        # e_score_correction_bias as loaded, for fine-tuning -- it still only picks (zero
        # gradient, no weight decay). Implied by balance_rate > 0.
        choosing_bias: bool = False
        # A learned bias on the router's logits (gpt-oss; param "bias"), trained as any param --
        # unlike balance_rate's expert bias, which only picks.
        bias: bool = False
        # Group-limited choice (DeepSeek-V3: 8 groups, 4 of them): the experts split into
        # num_groups consecutive groups, each scored by the sum of its two best choosing scores;
        # a token picks its top_k experts among the top_groups best groups only. 1: no groups.
        num_groups: int = 1
        # How many groups a token may choose from (HF topk_group); None: all of them.
        top_groups: Optional[int] = None

        def _validate_values(self):
            if isinstance(self.num_experts, int) and self.num_experts < 1:
                yield "num_experts", f"must be >= 1, got {self.num_experts}"
            if isinstance(self.model_dim, int) and self.model_dim < 1:
                yield "model_dim", f"must be >= 1, got {self.model_dim}"
            if isinstance(self.top_k, int) and self.top_k < 1:
                yield "top_k", f"must be >= 1, got {self.top_k}"
            elif isinstance(self.top_k, int) and isinstance(self.num_experts, int) and \
                    not 1 <= self.top_k <= self.num_experts:
                yield "top_k", f"must be in [1, num_experts={self.num_experts}], got {self.top_k}"
            if not 0 <= self.balance_rate <= 1:
                # Scores lie in [0, 1]: a larger step overshoots their whole range at once.
                yield "balance_rate", f"must be in [0, 1], got {self.balance_rate}"
            if self.routed_scaling <= 0:
                yield "routed_scaling", f"must be > 0, got {self.routed_scaling}"
            yield from _group_problems(self)

    def _create_layer_parameter_specs(self):
        cfg = self.config
        specs = {"weight": ParameterSpec(shape=(cfg.model_dim, cfg.num_experts),
                                         mesh_axes=(None, None),
                                         fan_axes=FanAxes(in_axes=(0,), out_axes=(1,)))}
        if _has_choosing_bias(cfg):
            # Not trained (its gradient is zero: it only picks); written as a state update
            # (kept whole under FSDP: the update replaces the whole value).
            specs["expert_bias"] = ParameterSpec(shape=(cfg.num_experts,), mesh_axes=(None,),
                                                 dtype=jnp.float32, initializer=constant(0.0),
                                                 weight_decay_scale=0.0, layer_state=True)
        if cfg.bias:
            specs["bias"] = ParameterSpec(shape=(cfg.num_experts,), mesh_axes=(None,),
                                          initializer=constant(0.0), weight_decay_scale=0.0)
        return specs

    def forward(self, tokens: jax.Array, valid: Optional[jax.Array] = None) -> Routing:
        """``valid`` ``[T]``: 0 for padding tokens (see ``Routing.valid``); None: all real."""
        cfg = self.config
        # (Counts in jax's default float: float32, float64 in its 64-bit mode.)
        valid = (jnp.ones(tokens.shape[:1], float) if valid is None
                 else jnp.asarray(valid).astype(jnp.result_type(float)))
        params = self.parameters
        logits = jnp.einsum("td,de->te", at_least_float32(tokens),
                            at_least_float32(params["weight"]))
        if cfg.bias:
            logits = logits + at_least_float32(params["bias"])
        if cfg.scoring == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
            probabilities = scores
        else:
            scores = jax.nn.sigmoid(logits)
            probabilities = scores / jnp.sum(scores, axis=-1, keepdims=True)
        choosing = scores
        if _has_choosing_bias(cfg):
            choosing = scores + jax.lax.stop_gradient(params["expert_bias"])
        if cfg.num_groups > 1:
            choosing = _within_top_groups(choosing, groups=cfg.num_groups,
                                          top_groups=cfg.top_groups or cfg.num_groups)
        _, expert_ids = jax.lax.top_k(jax.lax.stop_gradient(choosing), cfg.top_k)
        gates = jnp.take_along_axis(scores, expert_ids, axis=-1)
        if cfg.normalize_top_k or cfg.scoring == "sigmoid":
            gates = gates / (jnp.sum(gates, axis=-1, keepdims=True) + 1e-20)
        gates = gates * cfg.routed_scaling * valid[:, None]
        counts = assignment_counts(expert_ids, cfg.num_experts, valid)
        if cfg.balance_rate > 0 and self.is_training:
            mean = jnp.mean(counts)  # (All padding: no step.)
            step = cfg.balance_rate * jnp.where(mean > 0, 1.0 - counts / jnp.where(
                mean > 0, mean, 1.0), 0.0)
            # Added to the stored (float32) bias: the bfloat16 copy read here would round it.
            self.add_state_update("expert_bias", step, increment=True)
        return Routing(expert_ids=expert_ids.astype(jnp.int32), gates=gates, logits=logits,
                       probabilities=probabilities, valid=valid, counts=counts)


def _has_choosing_bias(cfg) -> bool:
    """Whether the router holds an expert bias that picks (and balance_rate moves)."""
    return cfg.choosing_bias or cfg.balance_rate > 0


def _group_problems(cfg):
    """Group-limited routing's fields against the experts and top_k (Config validation)."""
    groups, experts = cfg.num_groups, cfg.num_experts
    if groups < 1:
        yield "num_groups", f"must be >= 1, got {groups}"
        return
    if isinstance(experts, int) and experts % groups:
        yield "num_groups", f"must divide num_experts={experts}, got {groups}"
    elif isinstance(experts, int) and groups > 1 and experts // groups < 2:
        yield "num_groups", "each group needs two experts at least (it is scored by its best two)"
    top = cfg.top_groups
    if top is not None and not 1 <= top <= groups:
        yield "top_groups", f"must be in [1, num_groups={groups}] (or None), got {top}"
    elif top is not None and isinstance(experts, int) and isinstance(cfg.top_k, int) and \
            experts % groups == 0 and top * (experts // groups) < cfg.top_k:
        yield "top_groups", (f"{top} group(s) of {experts // groups} experts hold fewer than "
                             f"top_k={cfg.top_k}")


def _within_top_groups(choosing: jax.Array, *, groups: int, top_groups: int) -> jax.Array:
    """``choosing`` ``[T, E]`` with every expert outside a token's ``top_groups`` best groups
    set to -inf (a group's score: the sum of its two best)."""
    tokens, experts = choosing.shape
    grouped = choosing.reshape(tokens, groups, experts // groups)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, groups]
    _, best = jax.lax.top_k(group_scores, top_groups)
    kept = jnp.zeros((tokens, groups), bool).at[jnp.arange(tokens)[:, None], best].set(True)
    return jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(tokens, experts)


def assignment_counts(expert_ids: jax.Array, num_experts: int,
                      valid: Optional[jax.Array] = None) -> jax.Array:
    """``[num_experts]`` floats: how many (token, choice) assignments of real tokens (``valid``
    ``[T]``, None: all) each expert got."""
    weights = jnp.ones(expert_ids.shape, float) if valid is None else jnp.broadcast_to(
        valid[:, None], expert_ids.shape)
    return jnp.zeros((num_experts,), weights.dtype).at[expert_ids.reshape(-1)].add(
        weights.reshape(-1))


def load_balancing_loss(routing: Routing, num_experts: int) -> jax.Array:
    """Switch / GShard's auxiliary loss in Hugging Face's formula, for one layer (HF pools all
    layers' counts into one): ``E x sum_i f_i P_i`` with ``f_i`` the assignments to expert
    ``i`` per real token and ``P_i`` its mean probability -- ``top_k`` when perfectly balanced,
    up to ``E x top_k`` when one expert takes everything."""
    tokens = jnp.maximum(jnp.sum(routing.valid), 1.0)
    fraction = routing.counts / tokens
    mean_probability = jnp.sum(routing.probabilities * routing.valid[:, None], axis=0) / tokens
    return num_experts * jnp.sum(fraction * mean_probability)


def router_z_loss(routing: Routing) -> jax.Array:
    """ST-MoE's z-loss: the mean squared log-partition of the logits (keeps them small)."""
    squares = jnp.square(jax.nn.logsumexp(routing.logits, axis=-1))
    return jnp.sum(squares * routing.valid) / jnp.maximum(jnp.sum(routing.valid), 1.0)
