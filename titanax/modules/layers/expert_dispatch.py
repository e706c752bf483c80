"""Moving tokens to their experts and back: fixed-capacity slots, or a grouped (ragged) matmul.

Pure functions of local arrays, used by ``moe.MoE``.

**Capacity slots.** Each expert takes at most ``C`` of a token group's assignments. Assignments
queue choice-major -- every token's first choice before any token's second -- and in token order
within a choice, so a token loses its weakest choices first; an assignment past its expert's
``C`` is dropped (that token keeps its other experts, and the residual stream carries it on).
The kept ones are scattered into a ``[E, C, D]`` buffer, the experts run on it as one batched
matmul, and each token gathers its slots back, weighted by its gates. The shapes are fixed, which
is what an ``all_to_all`` over the expert axis needs: the buffer's expert dimension is split into
one chunk per expert-parallel rank, each rank receives its own experts' slots from every other
rank, and the reverse all-to-all takes the results home (``exchange``).

**Ragged.** Without expert parallelism nothing has to be fixed: the assignments are sorted by
expert and ``jax.lax.ragged_dot`` multiplies each expert's run of tokens by its weights -- no
slot is empty and none is dropped (``ragged_experts``).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from titanax.modules import float8
from titanax.parallel import collectives


def capacity(*, tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Slots per expert for a group of ``tokens``: ``ceil(factor x tokens x top_k / E)``, at
    least 1 and at most ``tokens`` (a token picks an expert once, so an expert never gets more;
    ``factor >= E / top_k`` therefore never drops)."""
    return min(tokens, max(1, math.ceil(factor * tokens * top_k / num_experts)))


def slot_positions(expert_ids: jax.Array, num_experts: int, *, valid: jax.Array,
                   slots: int) -> jax.Array:
    """``[T, top_k]`` int32: each assignment's place in its expert's queue (choice-major, then
    token order; see the module docstring); a padding token's (``valid`` 0) is ``slots``, out
    of every queue."""
    tokens, top_k = expert_ids.shape
    choice_major = expert_ids.T.reshape(-1)
    real = jnp.tile(valid > 0, top_k)
    one_hot = jax.nn.one_hot(choice_major, num_experts, dtype=jnp.int32) * real[:, None]
    places = jnp.sum((jnp.cumsum(one_hot, axis=0) - 1) * one_hot, axis=-1)
    places = jnp.where(real, places, slots)
    return places.reshape(top_k, tokens).T


def dispatch(tokens: jax.Array, expert_ids: jax.Array, positions: jax.Array, *,
             num_experts: int, slots: int) -> jax.Array:
    """``[E, slots, D]``: each kept assignment's token in its expert's slot (zeros elsewhere;
    assignments at ``positions >= slots`` are dropped)."""
    tokens_per_choice = jnp.broadcast_to(tokens[:, None, :],
                                         expert_ids.shape + tokens.shape[-1:])
    buffer = jnp.zeros((num_experts, slots, tokens.shape[-1]), tokens.dtype)
    return buffer.at[expert_ids, positions].add(tokens_per_choice, mode="drop")


def combine(buffer: jax.Array, expert_ids: jax.Array, positions: jax.Array,
            gates: jax.Array) -> jax.Array:
    """``[T, D]``: each token's experts' outputs (its slots of ``buffer``), weighted by its
    gates; a dropped assignment contributes nothing."""
    picked = buffer.at[expert_ids, positions].get(mode="fill", fill_value=0)
    return jnp.einsum("tkd,tk->td", picked, gates.astype(buffer.dtype))


def exchange(buffer: jax.Array, axis: str) -> jax.Array:
    """The all-to-all over the expert axis: ``[E, C, D]`` with rank ``r``'s experts in chunk
    ``r`` of the first dimension -> ``[E, C, D]`` holding, in chunk ``s``, rank ``s``'s slots for
    this rank's experts. Applied to the experts' outputs it is its own inverse."""
    return collectives.all_to_all(buffer, axis, split_dimension=0, concat_dimension=0)


def gated_experts(slots: jax.Array, gate_up: jax.Array, down: jax.Array,
                  glu: Callable, gate_up_bias: Optional[jax.Array] = None) -> jax.Array:
    """Gated experts on their slots: ``slots [E, N, D]``, ``gate_up [E, D, 2, F]`` (plus
    ``gate_up_bias [E, 2, F]``), ``down [E, F, D]`` -> ``[E, N, D]`` (one batched matmul per
    projection); ``glu(gate, up)`` is the hidden activation (SwiGLU: ``silu(gate) * up``)."""
    both = float8.einsum("end,edtf->entf", slots, gate_up.astype(slots.dtype))
    if gate_up_bias is not None:
        both = both + gate_up_bias[:, None].astype(both.dtype)
    hidden = glu(both[:, :, 0], both[:, :, 1])
    return float8.einsum("enf,efd->end", hidden, down.astype(slots.dtype))


def ragged_experts(tokens: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                   gate_up: jax.Array, down: jax.Array, glu: Callable,
                   gate_up_bias: Optional[jax.Array] = None) -> jax.Array:
    """``[T, D]``: every assignment through its expert with ``jax.lax.ragged_dot`` (sorted by
    expert, one group per expert; nothing dropped), weighted by the gates (``glu`` and
    ``gate_up_bias`` as ``gated_experts``')."""
    num_tokens, top_k = expert_ids.shape
    experts, width, _, hidden_width = gate_up.shape
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
    ordered = tokens[order // top_k]
    both = jax.lax.ragged_dot(ordered, gate_up.reshape(experts, width, 2 * hidden_width)
                              .astype(tokens.dtype), sizes)
    both = both.reshape(-1, 2, hidden_width)
    if gate_up_bias is not None:  # Each sorted assignment's expert's bias.
        both = both + gate_up_bias[flat[order]].astype(both.dtype)
    outputs = jax.lax.ragged_dot(glu(both[:, 0], both[:, 1]), down.astype(tokens.dtype), sizes)
    restored = outputs[jnp.argsort(order)].reshape(num_tokens, top_k, -1)
    return jnp.einsum("tkd,tk->td", restored, gates.astype(tokens.dtype))
