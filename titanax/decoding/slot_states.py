"""The device side of the caches that do not grow with a sequence: a recurrent layer's state,
one per decode slot.

Why: a Gated DeltaNet layer (Qwen 3.5) carries a fixed-size state -- its convolution's last
``K - 1`` inputs and the delta rule's ``[heads, d_k, d_v]`` matrix -- whatever the sequence's
length. Paging it in blocks would buy nothing: each sequence holds exactly one, so the engine
keeps one per slot of the decode batch, ``[slots, ...]`` per layer, beside the attention
layers' block pools. A prompt's samples share its prefill as they share its blocks: the state
the prefill leaves in the first sample's slot is copied to the others' (``copy_prompts``).

Layout, as the placement lays pools out (``placement.py``): slots on dimension -4, a layer's
local heads on -2. A convolution window is ``[slots, K - 1, heads, width]``; the rule's state is
kept ``[slots, d_k, heads, d_v]`` and moved to the rule's ``[b, heads, d_k, d_v]`` when read.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from titanax.decoding import paged_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotStates:
    """One recurrent layer's states (or a stack's, stacked over its layers on a leading
    dimension): the convolution windows of its q, k and v, and the rule's state."""

    windows: Tuple[jax.Array, ...]
    state: jax.Array


def empty(*, windows, state, dtype, state_dtype) -> SlotStates:
    """Zeros: ``windows`` the windows' shapes ``[.., slots, K - 1, heads, width]``, ``state``
    the rule state's ``[.., slots, heads, d_k, d_v]`` (kept with heads and d_k swapped)."""
    *lead, heads, d_k, d_v = state
    return SlotStates(windows=tuple(jnp.zeros(w, dtype) for w in windows),
                      state=jnp.zeros((*lead, d_k, heads, d_v), state_dtype))


def read(states: SlotStates, slots: jax.Array, *, fresh: jax.Array,
         layer: Optional[jax.Array] = None) -> Tuple[Tuple[jax.Array, ...], jax.Array]:
    """The windows ``[b, K - 1, heads, width]`` and the rule's state ``[b, heads, d_k, d_v]``
    of each row's slot ``slots`` ``[b]`` (-1: none; reads zeros), from layer ``layer`` of a
    stack's states when given; zeros for the rows ``fresh`` ``[b]`` marks (a sequence's first
    tokens: whatever the slot held before is another sequence's)."""
    start = (slots < 0) | fresh

    def rows(array):
        picked = array[jnp.maximum(slots, 0)] if layer is None else \
            array[layer, jnp.maximum(slots, 0)]
        return jnp.where(start.reshape((-1,) + (1,) * (picked.ndim - 1)), 0, picked)

    state = jnp.swapaxes(rows(states.state), 1, 2)
    return tuple(rows(w) for w in states.windows), state


def written(states: SlotStates, windows: Tuple[jax.Array, ...], state: jax.Array,
            slots: jax.Array, *, layer: Optional[jax.Array] = None) -> SlotStates:
    """``states`` with each row's new ``windows`` and ``state`` (``read``'s shapes) in its slot
    (into layer ``layer``'s of a stack); a row of slot -1 writes nothing."""
    count = states.state.shape[-4]
    target = jnp.where(slots >= 0, slots, count)  # (Past the end: ``mode="drop"`` drops it.)

    def put(array, new):
        new = new.astype(array.dtype)
        if layer is None:
            return array.at[target].set(new, mode="drop")
        return array.at[layer, target].set(new, mode="drop")

    return SlotStates(windows=tuple(put(a, w) for a, w in zip(states.windows, windows)),
                      state=put(states.state, jnp.swapaxes(state, 1, 2)))


def copy_prompts(pools, block_sources: jax.Array, block_targets: jax.Array,
                 slot_sources: jax.Array, slot_targets: jax.Array):
    """``pools`` (the model's paged cache: block pools and slot states) with each prompt's
    prefill shared by its other samples: block ``block_sources[i]`` copied to
    ``block_targets[i]`` (a prompt's partly filled last block), slot ``slot_sources[i]``'s
    states to ``slot_targets[i]``."""
    def copy(leaf):
        if isinstance(leaf, SlotStates):
            return jax.tree_util.tree_map(
                lambda a: _copy_along(a, a.ndim - 4, slot_sources, slot_targets), leaf)
        return paged_attention.copy_blocks(leaf, block_sources, block_targets)
    return jax.tree_util.tree_map(copy, pools, is_leaf=lambda x: isinstance(x, SlotStates))


def _copy_along(array, axis, sources, targets):
    index = (slice(None),) * axis
    return array.at[index + (targets,)].set(array[index + (sources,)])


def holds_states(pools) -> bool:
    """Whether the model's paged cache has slot states (a recurrent layer)."""
    return any(isinstance(leaf, SlotStates) for leaf in jax.tree_util.tree_leaves(
        pools, is_leaf=lambda x: isinstance(x, SlotStates)))
