"""Context parallelism: the sequence dimension of every activation split over a mesh axis.

``CP`` is the plan part (``Plan.context_parallel``). The batch's ``[rows, seq]`` arrays are split
along ``seq`` over ``axis`` before the embedding, as rows are over the data axis, and every token
keeps its own ``positions`` (the host adds ``0 .. seq-1`` when the batch has none) and
``segment_ids``. Params are replicated over the axis, so the reducer reduces their gradients
there like over a data axis, weighted by each device's trained tokens. Attention talks across
it (``context_attention.py``), and so does Gated DeltaNet, whose state and convolution run along
the sequence (``context_delta_rule.py``).

**Load balance.** Under a causal mask the last tokens of a row attend to the most keys: with the
sequence cut into C contiguous chunks, rank C-1 does about 2C-1 times rank 0's attention work.
``load_balance="dual_chunk"`` cuts each row into 2C chunks and gives rank r chunks r and 2C-1-r
(a light one and a heavy one): the host reorders the sequence dimension before placing the batch
(``dual_chunk_order``), so nothing moves on the devices, and the causal mask is taken from the
tokens' positions, not their places in the local array. The loss is a sum over tokens, so the
order does not change it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Literal, Mapping, Optional

import jax
import numpy as np
from jax.sharding import PartitionSpec

from titanax import errors
from titanax.config import Configurable


class CP(Configurable):
    """Context parallelism over ``axis`` (see the module docstring)."""

    class Config(Configurable.Config):
        # Mesh axis the sequence dimension is split over.
        axis: str = "context"
        # How attention sees the keys of the other ranks' tokens: "all_gather" (every rank
        # gathers the whole sequence's K/V; the most memory, one collective per layer),
        # "ring" (K/V blocks passed around a ppermute ring under an online softmax) or
        # "ulysses" (all-to-all from sequence shards to head shards and back).
        strategy: Literal["all_gather", "ring", "ulysses"] = "all_gather"
        # "dual_chunk": rank r holds chunks r and 2C-1-r of each row, so every rank does the
        # same causal attention work; "none": contiguous chunks.
        load_balance: Literal["dual_chunk", "none"] = "dual_chunk"

    def __init__(self, cfg=None, **fields):
        super().__init__(cfg, **fields)
        # The row length of the latest batch prepared (for --explain); None before one.
        self.sequence_length: Optional[int] = None

    def describe(self, *, size: int, length: Optional[int] = None) -> str:
        """--explain's lines: the split, the per-device sequence, what attention sends."""
        cfg = self.config
        traffic = {"all_gather": "K/V all-gathered once per layer (the whole row's K/V on every "
                                 "rank), their gradients reduce-scattered",
                   "ring": f"K/V blocks passed {size - 1} times around a ppermute ring per layer "
                           f"(forward), K/V {size - 1} and their gradients {size} times "
                           "(backward); one visiting block in memory",
                   "ulysses": "q, k, v all-to-all from sequence to head shards and the output "
                              "back, per layer"}[cfg.strategy]
        lines = [f"context parallelism over {cfg.axis!r} ({size} devices), strategy "
                 f"{cfg.strategy}: {traffic}"]
        order = (f"each row cut into {2 * size} chunks, rank r holding chunks r and "
                 f"{2 * size - 1}-r (the same causal work on every rank)"
                 if cfg.load_balance == "dual_chunk" else "each row cut into contiguous chunks")
        lines.append(f"  load balance {cfg.load_balance}: {order}")
        if length is not None:
            lines.append(f"  sequence per device: {length} / {size} = {length // size} tokens")
        return "\n".join(lines)

    def chunks(self, size: int) -> int:
        """How many equal chunks a row is cut into on an axis of ``size`` devices."""
        return 2 * size if self.config.load_balance == "dual_chunk" else size

    def prepare(self, batch: Mapping[str, Any], *, size: int) -> Dict[str, Any]:
        """A host batch ready to be split along its sequence: ``positions`` added when absent,
        every ``[rows, seq]`` array in the load-balanced order (a new dict; the input's arrays
        are not changed)."""
        out = dict(batch)
        ids = out.get("input_ids")
        if ids is None or np.ndim(ids) != 2:
            raise errors.PlanError(
                "context parallelism splits token sequences: the batch has no [rows, seq] "
                "input_ids", path="plan.context_parallel",
                suggestion="use a language model's input (input_ids, target_ids, ...), or set "
                           "plan.context_parallel=None")
        rows, length = np.shape(ids)
        self.sequence_length = length
        odd = [k for k, v in out.items() if np.ndim(v) >= 2 and np.shape(v)[1] != length]
        if odd:
            raise errors.PlanError(
                f"batch field {odd[0]!r} is {np.shape(out[odd[0]])}: context parallelism splits "
                f"the second dimension of every [rows, seq, ...] array, and it is not the "
                f"sequence ({length} tokens)", path="plan.context_parallel",
                suggestion="give per-row values as [rows] arrays, per-token ones as [rows, seq]")
        chunks = self.chunks(size)
        if length % chunks:
            raise errors.PlanError(
                f"sequences of {length} tokens do not split into {chunks} equal chunks "
                f"({size} devices on {self.config.axis!r}"
                + (", two chunks each: load_balance='dual_chunk')"
                   if self.config.load_balance == "dual_chunk" else ")"),
                path="plan.context_parallel.axis",
                suggestion=f"use a sequence length that is a multiple of {chunks}")
        if out.get("positions") is None:
            out["positions"] = np.broadcast_to(np.arange(length, dtype=np.int32),
                                               (rows, length)).copy()
        if self.config.load_balance == "dual_chunk":
            order = dual_chunk_order(length, size)
            out = {k: (np.asarray(v)[:, order] if np.ndim(v) >= 2 and np.shape(v)[1] == length
                       else v) for k, v in out.items()}
        return out


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """CP's transform in the layout pipeline (parallel/layout.py): each row's sequence split
    over ``axis`` in ``order``'s chunks, and that axis crossed by the data all-reduce (the
    params stay whole over it, so their gradients are reduced there like over a data axis)."""

    axis: str
    # How the host cuts and orders each row (the plan's CP part: chunks, prepare).
    order: Any
    name: str = "sequence split (CP)"

    def apply(self, layout):
        from titanax.parallel import rules  # pylint: disable=import-outside-toplevel
        split = [spec for spec in jax.tree_util.tree_leaves(
            layout.param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
            if self.axis in rules.spec_axes(spec)] if layout.param_specs is not None else []
        if split:
            raise errors.PlanError(
                f"a param is split over {self.axis!r}, which the data all-reduce crosses as a "
                "batch axis", path="plan.context_parallel",
                suggestion="keep params whole over the context axis")
        batch = dataclasses.replace(layout.batch, sequence_axis=self.axis,
                                    sequence_order=self.order,
                                    fold_axes=layout.batch.fold_axes + (self.axis,))
        return layout.evolve(self.name, batch=batch)


def dual_chunk_order(length: int, size: int) -> np.ndarray:
    """The token order along a row such that rank r's contiguous share holds chunks r and
    2C-1-r of the original (C = ``size``; ``length`` divisible by 2C)."""
    chunk = length // (2 * size)
    pieces = []
    for rank in range(size):
        for index in (rank, 2 * size - 1 - rank):
            pieces.append(np.arange(index * chunk, (index + 1) * chunk))
    return np.concatenate(pieces)


def causal_work(length: int, size: int, *, load_balance: str) -> np.ndarray:
    """Per rank, the (query, key) pairs its causal attention computes, from the schedule: the
    load each rank carries (``load_balance`` "dual_chunk" or "none")."""
    order = (dual_chunk_order(length, size) if load_balance == "dual_chunk"
             else np.arange(length))
    share = length // size
    # A query at position p sees p + 1 keys (itself and every earlier one).
    return np.asarray([int(np.sum(order[r * share:(r + 1) * share] + 1)) for r in range(size)])
