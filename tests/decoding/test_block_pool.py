"""The paged cache's book (titanax/decoding/block_pool.py): a prompt's full blocks held once by
all its samples, tails and new blocks each sample's own, every block back when its last holder
ends -- checked against a recount from the tables after every change of a random workload."""

import numpy as np
import pytest

from titanax import errors
from titanax.decoding.block_pool import BlockPool


def _recount(pool, live):
    """Holders per block and the free count, from the live sequences' tables alone."""
    holders = [0] * pool.num_blocks
    for sequence in live:
        for block in pool.table(sequence):
            holders[block] += 1
    return holders, holders.count(0)


def test_a_group_holds_its_prompts_full_blocks_once_and_a_tail_per_sample():
    pool = BlockPool(num_blocks=32, block_size=4)
    pool.add_group(sequences=[0, 1, 2], prompt_length=10)  # 2 full blocks, a tail of 2 tokens.
    tables = [pool.table(s) for s in range(3)]
    assert all(t[:2] == tables[0][:2] for t in tables)  # Shared, not copied.
    assert len({t[2] for t in tables}) == 3  # Each its own tail.
    assert [pool.holders(b) for b in tables[0]] == [3, 3, 1]
    assert pool.free_blocks == 32 - 2 - 3 == 32 - pool.group_cost(prompt_length=10, samples=3)
    # A prompt that fills its blocks leaves no tail: the samples' first tokens open new blocks.
    pool.add_group(sequences=[3, 4], prompt_length=8)
    assert pool.table(3) == pool.table(4) and len(pool.table(3)) == 2
    pool.grow(3, to_length=9)
    pool.grow(4, to_length=9)
    assert pool.table(3)[:2] == pool.table(4)[:2] and pool.table(3)[2] != pool.table(4)[2]


def test_growth_takes_a_block_only_past_a_block_boundary_and_the_last_holder_frees():
    pool = BlockPool(num_blocks=8, block_size=4)
    pool.add_group(sequences=[7, 9], prompt_length=6)
    free = pool.free_blocks
    pool.grow(7, to_length=8)  # Still inside its tail block.
    assert pool.free_blocks == free and pool.length(7) == 8 and pool.length(9) == 6
    pool.grow(7, to_length=9)
    assert pool.free_blocks == free - 1 and len(pool.table(7)) == 3
    shared = pool.table(9)[0]
    pool.release(7)
    assert pool.holders(shared) == 1 and pool.free_blocks == free + 1  # Its tail and new block.
    pool.release(9)
    assert pool.free_blocks == 8 and all(pool.holders(b) == 0 for b in range(8))


def test_a_random_workload_keeps_the_book_equal_to_a_recount_of_the_tables():
    rng = np.random.default_rng(0)
    pool = BlockPool(num_blocks=64, block_size=4)
    live, next_id, refused = set(), 0, 0
    for _ in range(2000):
        action = rng.integers(3)
        if action == 0:
            samples, length = int(rng.integers(1, 5)), int(rng.integers(1, 20))
            ids = list(range(next_id, next_id + samples))
            if pool.group_cost(prompt_length=length, samples=samples) <= pool.free_blocks:
                pool.add_group(sequences=ids, prompt_length=length)
                live.update(ids)
                next_id += samples
            else:
                with pytest.raises(errors.DecodingError, match="pool_tokens"):
                    pool.add_group(sequences=ids, prompt_length=length)
                refused += 1
        elif live and action == 1:
            sequence = int(rng.choice(sorted(live)))
            to_length = pool.length(sequence) + int(rng.integers(1, 6))
            if pool.blocks_for(to_length) - len(pool.table(sequence)) <= pool.free_blocks:
                pool.grow(sequence, to_length=to_length)
        elif live:
            sequence = int(rng.choice(sorted(live)))
            pool.release(sequence)
            live.remove(sequence)
        holders, free = _recount(pool, live)
        assert [pool.holders(b) for b in range(64)] == holders and pool.free_blocks == free
        assert all(len(pool.table(s)) == pool.blocks_for(pool.length(s)) for s in live)
    assert refused > 0 and next_id > 100  # The pool filled up and emptied many times over.


@pytest.mark.parametrize("num_blocks,block_size", [(0, 4), (8, 0), (-1, 4)])
def test_a_pool_of_no_blocks_or_of_blocks_of_no_tokens_is_refused_by_name(num_blocks, block_size):
    with pytest.raises(errors.DecodingError, match="decoding.block_size"):
        BlockPool(num_blocks=num_blocks, block_size=block_size)


def test_a_group_of_no_samples_and_a_sequence_added_twice_are_refused():
    pool = BlockPool(num_blocks=8, block_size=4)
    with pytest.raises(errors.DecodingError, match="num_samples"):
        pool.add_group(sequences=[], prompt_length=5)
    pool.add_group(sequences=[0], prompt_length=5)
    with pytest.raises(errors.DecodingError, match="already have"):
        pool.add_group(sequences=[0, 1], prompt_length=5)
    assert pool.free_blocks == 6  # The refused group took nothing.
