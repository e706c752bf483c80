"""The host's book of a paged key/value cache: fixed-size blocks, who holds each, and each
sequence's block table.

Why paged: a contiguous cache gives every row ``prompt + max_new_tokens`` positions for the
whole batch's life, so memory goes to rows' unused tails and a finished row's room waits for the
batch's longest. Blocks of ``block_size`` tokens are handed out as a sequence grows and taken
back when it ends, so the pool is sized in tokens, a finished sequence's room goes at once to the
next request, and the samples of one prompt hold its prompt's full blocks *once* (a block counts
its holders; the last holder's release frees it).

A group of samples of one prompt: the prompt's full blocks are shared by every sample; its last,
partly filled block is each sample's own (each writes its own next tokens into it), so prefill
writes that tail once per sample and nothing is ever copied on write. The device never sees this
book, only the block tables (``table``) it indexes the pool with.
"""

from __future__ import annotations

import collections
from typing import Dict, List, Sequence

from titanax import errors


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens; each free or held by one or more
    sequences."""

    def __init__(self, *, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise errors.DecodingError(
                f"a pool needs at least one block of at least one token, got {num_blocks} "
                f"block(s) of {block_size}", path="decoding.block_size",
                suggestion="size the pool in tokens >= the longest request, blocks >= 1 token")
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Lowest first: the same requests take the same blocks on every process and every run.
        self._free = collections.deque(range(num_blocks))
        self._holders = [0] * num_blocks
        self._tables: Dict[int, List[int]] = {}
        self._lengths: Dict[int, int] = {}

    # --- Counting ---------------------------------------------------------------------------

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_size)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def holders(self, block: int) -> int:
        """How many sequences hold ``block`` (0: free)."""
        return self._holders[block]

    def table(self, sequence: int) -> List[int]:
        """``sequence``'s blocks, in the order of its positions."""
        return list(self._tables[sequence])

    def length(self, sequence: int) -> int:
        """The tokens ``sequence``'s blocks have room for now (its prompt and what it drew)."""
        return self._lengths[sequence]

    def group_cost(self, *, prompt_length: int, samples: int) -> int:
        """Free blocks ``add_group`` takes: the prompt's full blocks once, its tail per sample."""
        full, tail = divmod(prompt_length, self.block_size)
        return full + samples * (1 if tail else 0)

    # --- Changing -----------------------------------------------------------------------------

    def add_group(self, *, sequences: Sequence[int], prompt_length: int) -> None:
        """Tables for ``sequences``, the samples of one prompt of ``prompt_length`` tokens: its
        full blocks shared by all, its partly filled last block one per sample."""
        if not sequences:
            raise errors.DecodingError("a group needs at least one sample", path="num_samples",
                                       suggestion="ask for num_samples >= 1")
        taken = [s for s in sequences if s in self._tables]
        if taken or len(set(sequences)) != len(sequences):
            raise errors.DecodingError(f"sequences {taken or list(sequences)} already have "
                                       f"blocks", path="decoding.sequences")
        self._check_room(self.group_cost(prompt_length=prompt_length, samples=len(sequences)))
        full, tail = divmod(prompt_length, self.block_size)
        shared = self._take(full)
        for block in shared:
            self._holders[block] = len(sequences)
        for sequence in sequences:
            self._tables[sequence] = shared + (self._take(1) if tail else [])
            for block in self._tables[sequence][full:]:
                self._holders[block] = 1
            self._lengths[sequence] = prompt_length

    def grow(self, sequence: int, *, to_length: int) -> None:
        """Room for ``sequence``'s first ``to_length`` tokens (its new blocks its own)."""
        table = self._tables[sequence]
        needed = self.blocks_for(to_length) - len(table)
        if needed > 0:
            self._check_room(needed)
            for block in self._take(needed):
                self._holders[block] = 1
                table.append(block)
        self._lengths[sequence] = max(self._lengths[sequence], to_length)

    def release(self, sequence: int) -> None:
        """``sequence`` ends: each of its blocks loses a holder, the last holder frees it."""
        for block in self._tables.pop(sequence):
            self._holders[block] -= 1
            if self._holders[block] == 0:
                self._free.append(block)
        del self._lengths[sequence]

    def _take(self, count: int) -> List[int]:
        return [self._free.popleft() for _ in range(count)]

    def _check_room(self, count: int) -> None:
        if count > len(self._free):
            raise errors.DecodingError(
                f"{count} block(s) needed, {len(self._free)} free of {self.num_blocks}",
                path="decoding.pool_tokens",
                suggestion="admit a request only when group_cost fits, or make the pool larger")
