"""Paged attention (titanax/decoding/paged_attention.py) against attention written out in numpy
over each row's own contiguous keys: groups of samples whose prompts' full blocks are written
once (through the first sample's table) and read by all, rows of different lengths decoding
together, grouped-query heads, a sliding window and sinks -- float64."""

import numpy as np
import pytest
import jax.numpy as jnp

from titanax.decoding import paged_attention
from titanax.decoding.block_pool import BlockPool
from tests.numerics import FLOAT64, assert_close

pytestmark = pytest.mark.usefixtures("float64_numerics")

BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 8
GROUPS = ((7, 3), (12, 2), (1, 1))  # (prompt length, samples): a tail, none, a one-token prompt.


def _reference(q, keys, values, *, scale, window, sinks):
    """One row: ``q`` [t, heads, d] at the last t of ``keys``/``values`` [s, kv, d]."""
    t, s = q.shape[0], keys.shape[0]
    out = np.zeros(q.shape[:2] + (values.shape[-1],))
    for h in range(HEADS):
        g = h // (HEADS // KV_HEADS)
        for i in range(t):
            position = s - t + i
            seen = [j for j in range(position + 1) if window is None or j > position - window]
            scores = np.array([q[i, h] @ keys[j, g] * scale for j in seen])
            logits = np.concatenate([scores, [sinks[h]]]) if sinks is not None else scores
            probs = np.exp(logits - logits.max())
            probs = probs[:len(seen)] / probs.sum()
            out[i, h] = probs @ values[seen, g]
    return out


def _padded(tables, width):
    return np.array([t + [0] * (width - len(t)) for t in tables], np.int32)


@pytest.mark.parametrize("window,with_sinks", [(None, False), (5, False), (None, True)],
                         ids=["full", "window-5", "sinks"])
def test_rows_of_shared_prompts_decode_as_their_own_contiguous_caches(window, with_sinks):
    rng = np.random.default_rng(0)
    pool = BlockPool(num_blocks=40, block_size=BLOCK)
    rows, prompts, next_id = [], [], 0
    for length, samples in GROUPS:
        ids = list(range(next_id, next_id + samples))
        pool.add_group(sequences=ids, prompt_length=length)
        prompts.append((rng.normal(size=(length, KV_HEADS, DIM)),
                        rng.normal(size=(length, KV_HEADS, DIM))))
        rows += [(i, len(prompts) - 1, sample) for sample, i in enumerate(ids)]
        next_id += samples
    k_pool = jnp.zeros((40, BLOCK, KV_HEADS, DIM), jnp.float64)
    v_pool = jnp.zeros_like(k_pool)
    # Prefill: the first sample writes its whole prompt; the others only their own tail, so
    # they read the shared full blocks the first one wrote.
    longest = max(length for length, _ in GROUPS)
    positions, k_new, v_new = [], [], []
    for _, prompt, sample in rows:
        length, full = prompts[prompt][0].shape[0], prompts[prompt][0].shape[0] // BLOCK * BLOCK
        first = 0 if sample == 0 else full
        positions.append([p if first <= p < length else -1 for p in range(longest)])
        k_new.append(np.pad(prompts[prompt][0], [(0, longest - length), (0, 0), (0, 0)]))
        v_new.append(np.pad(prompts[prompt][1], [(0, longest - length), (0, 0), (0, 0)]))
    steps = 5
    for sequence, prompt, _ in rows:
        pool.grow(sequence, to_length=prompts[prompt][0].shape[0] + steps)
    width = max(len(pool.table(s)) for s, _, _ in rows)
    tables = jnp.asarray(_padded([pool.table(s) for s, _, _ in rows], width))
    k_pool = paged_attention.write(k_pool, jnp.asarray(np.stack(k_new)), tables=tables,
                                   positions=jnp.asarray(positions))
    v_pool = paged_attention.write(v_pool, jnp.asarray(np.stack(v_new)), tables=tables,
                                   positions=jnp.asarray(positions))
    keys = [prompts[p][0] for _, p, _ in rows]
    values = [prompts[p][1] for _, p, _ in rows]
    sinks = rng.normal(size=HEADS) if with_sinks else None
    scale = DIM ** -0.5
    for _ in range(steps):  # Each row one new token at its own length.
        lengths = np.array([k.shape[0] for k in keys])
        k_step, v_step = (rng.normal(size=(len(rows), 1, KV_HEADS, DIM)) for _ in range(2))
        k_pool = paged_attention.write(k_pool, jnp.asarray(k_step), tables=tables,
                                       positions=jnp.asarray(lengths[:, None]))
        v_pool = paged_attention.write(v_pool, jnp.asarray(v_step), tables=tables,
                                       positions=jnp.asarray(lengths[:, None]))
        keys = [np.concatenate([k, k_step[i]]) for i, k in enumerate(keys)]
        values = [np.concatenate([v, v_step[i]]) for i, v in enumerate(values)]
        q = rng.normal(size=(len(rows), 1, HEADS, DIM))
        got = paged_attention.attend(
            jnp.asarray(q), paged_attention.gathered(k_pool, tables),
            paged_attention.gathered(v_pool, tables), positions=jnp.asarray(lengths[:, None]),
            scale=scale, sliding_window=window,
            sinks=None if sinks is None else jnp.asarray(sinks))
        want = np.stack([_reference(q[i], keys[i], values[i], scale=scale, window=window,
                                    sinks=sinks) for i in range(len(rows))])
        assert_close(np.asarray(got), want, bound=FLOAT64, what="paged decoding step")


def test_a_prompt_attends_over_itself_when_prefilled():
    """Prefill's queries (every prompt token at once, rows of different lengths right-padded
    with -1 positions) see each row's causal prefix."""
    rng = np.random.default_rng(1)
    pool = BlockPool(num_blocks=16, block_size=BLOCK)
    lengths = [9, 3]
    for sequence, length in enumerate(lengths):
        pool.add_group(sequences=[sequence], prompt_length=length)
    tables = jnp.asarray(_padded([pool.table(s) for s in range(2)], 3))
    t = max(lengths)
    k, v, q = (rng.normal(size=(2, t, n, DIM)) for n in (KV_HEADS, KV_HEADS, HEADS))
    positions = jnp.asarray([[p if p < n else -1 for p in range(t)] for n in lengths])
    k_pool = paged_attention.write(jnp.zeros((16, BLOCK, KV_HEADS, DIM)), jnp.asarray(k),
                                   tables=tables, positions=positions)
    v_pool = paged_attention.write(jnp.zeros((16, BLOCK, KV_HEADS, DIM)), jnp.asarray(v),
                                   tables=tables, positions=positions)
    for row, length in enumerate(lengths):  # Each row's queries: its own tokens only.
        got = paged_attention.attend(
            jnp.asarray(q[row:row + 1, :length]),
            paged_attention.gathered(k_pool, tables[row:row + 1]),
            paged_attention.gathered(v_pool, tables[row:row + 1]),
            positions=positions[row:row + 1, :length], scale=0.3)
        want = _reference(q[row, :length], k[row, :length], v[row, :length], scale=0.3,
                          window=None, sinks=None)
        assert_close(np.asarray(got[0]), want, bound=FLOAT64, what=f"prefill row {row}")


def test_a_layer_of_a_stacked_pool_is_written_and_read_in_place_of_its_own():
    """A stack's pools ``[layers, blocks, ...]`` carried whole: writing layer 1 through
    ``layer=`` is writing its own pool alone (layer 0 untouched), and gathering it reads the
    same keys."""
    rng = np.random.default_rng(2)
    stacked = jnp.asarray(rng.normal(size=(2, 8, BLOCK, KV_HEADS, DIM)))
    tables = jnp.asarray([[3, 5], [6, 1]])
    positions = jnp.asarray([[0, 1, BLOCK + 1], [2, -1, -1]])
    new = jnp.asarray(rng.normal(size=(2, 3, KV_HEADS, DIM)))
    got = paged_attention.write(stacked, new, tables=tables, positions=positions,
                                layer=jnp.asarray(1))
    alone = paged_attention.write(stacked[1], new, tables=tables, positions=positions)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(alone))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(stacked[0]))
    assert not np.array_equal(np.asarray(alone), np.asarray(stacked[1]))
    np.testing.assert_array_equal(
        np.asarray(paged_attention.gathered(got, tables, layer=jnp.asarray(1))),
        np.asarray(paged_attention.gathered(alone, tables)))
