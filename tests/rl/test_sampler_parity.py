"""Sampler vs trainer: the log-prob the sampler reports for each token it drew equals the one
the train step computes for it -- the same rows, the same params, the same mesh, prompts of
4 to 8 tokens left-padded into one batch, a temperature of 0.8 -- within 1e-5 (float32) under
DP, TP and FSDP. (The train step reports the mean difference as
``sampling/logp_difference/mean``: ~0 on a rollout's first update.)"""

import jax
import numpy as np
import pytest

from tests.numerics import assert_close
from tests.rl import helpers


@pytest.mark.parametrize("layout", sorted(helpers.LAYOUTS))
def test_the_train_step_recomputes_the_samplers_log_probs(tmp_path, layout):
    engine = helpers.engine(helpers.sums_file(tmp_path / "sums.jsonl"), layout=layout)
    engine.init_or_restore()
    stream = engine._configured_iterator()  # pylint: disable=protected-access
    rows, _ = next(stream)
    assert len(set(rows["segment_ids"].sum(axis=1).tolist())) > 1, "prompts of one length"
    mask = rows["weights"] > 0
    assert mask.sum() > 0.5 * mask.shape[0] * 8 - 1
    trained = helpers.recomputed_logps(engine, engine.state.params, rows)
    difference = np.abs(trained - rows["old_logps"])[mask]
    assert difference.max() <= 1e-5, difference.max()
    assert np.abs(rows["old_logps"][mask]).mean() > 0.5, "log-probs this near 0 prove little"
    metrics = engine.train_step(rows)
    assert float(metrics["sampling/logp_difference/mean"]) <= 1e-5


@pytest.mark.parametrize("layout", ["dp", "dp_tp"])
def test_sampling_stops_when_every_row_has_ended_and_samples_alike(tmp_path, layout):
    """With end ids the sampler stops once every row (of every batch shard) has drawn one: up
    to each row's end the tokens and log-probs are those of the run without a stop; after it,
    the end id and 0."""
    engine = helpers.engine(helpers.sums_file(tmp_path / "sums.jsonl"), layout=layout)
    engine.init_or_restore()
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, 16, (16, 5)).astype(np.int32)
    lengths = rng.integers(2, 6, (16,)).astype(np.int32)
    placed = engine.inputs.placed({"prompt_ids": prompts, "prompt_lengths": lengths})
    key = jax.random.PRNGKey(3)
    outs = {}
    for ends in ((), (2, 5)):
        sample = engine.steps.sampler(max_new_tokens=24, temperature=1.5, end_ids=ends)
        outs[ends] = {k: np.asarray(v) for k, v in sample(
            engine.state.params, placed["prompt_ids"], placed["prompt_lengths"], key).items()}
    full, stopped = outs[()], outs[(2, 5)]
    from titanax.rl.rows import completion_mask  # pylint: disable=import-outside-toplevel
    mask = completion_mask(full["tokens"], (2, 5)) > 0
    assert mask.all(axis=1).sum() < len(mask) and not mask.all(), "no row ends: proves little"
    np.testing.assert_array_equal(stopped["tokens"][mask], full["tokens"][mask])
    for name in ("logps", "entropy"):  # Two programs (with and without the stop): float32's
        assert_close(stopped[name][mask], full[name][mask], what=name)  # rounding, not bits.
    last_end = int(mask.sum(axis=1).max())
    assert (stopped["tokens"][:, last_end:] == 2).all()
    assert (stopped["logps"][:, last_end:] == 0).all()
