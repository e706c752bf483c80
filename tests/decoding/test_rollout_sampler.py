"""GRPO's rollouts through the decode engine (``objective.decoding``;
titanax/decoding/rollout_sampler.py): the train step recomputes the log-prob the engine reported
for every sampled token within 1e-5 (float32) under DP, DP x TP and FSDP -- the rollout rows
(left-padded prompt, completion, its end, positions) are the ones the engine decoded; each
group's samples differ; a rollout's key decides its tokens (a resumed run's rollout n is the
uninterrupted run's); sizes the engine cannot serve are refused by name."""

import jax
import numpy as np
import pytest

from tests.rl import helpers
from titanax import errors
from titanax.decoding.rollout_sampler import PagedDecoding
from titanax.objectives.grpo import GRPO
from titanax.rl.rewards import AnswerMatch


def _grpo(**decoding):
    return GRPO.default_config().set(
        num_generations=4, max_new_tokens=8, temperature=0.8,
        rewards={"answer": AnswerMatch.default_config()},
        decoding=PagedDecoding.default_config().set(
            **{"block_size": 4, "chunk_steps": 3, **decoding}))


@pytest.mark.parametrize("layout", sorted(helpers.LAYOUTS))
def test_the_train_step_recomputes_the_engines_log_probs(tmp_path, layout):
    run = helpers.engine(helpers.sums_file(tmp_path / "sums.jsonl"), layout=layout,
                         grpo=_grpo(slots=4))
    run.init_or_restore()
    stream = run._configured_iterator()  # pylint: disable=protected-access
    rows, metrics = next(stream)
    assert metrics["rollout/tokens_per_s"] > 0
    mask = rows["weights"] > 0
    ended = mask.sum(axis=1) < 8
    assert ended.any(), "no completion ended before its budget: the stop path is untested"
    # After its end id a completion's places hold that id, as the static sampler's.
    for row in np.flatnonzero(ended):
        completion = rows["target_ids"][row, -8:]
        end = int(mask[row].sum()) - 1
        assert (completion[end:] == completion[end]).all(), completion
    trained = helpers.recomputed_logps(run, run.state.params, rows)
    difference = np.abs(trained - rows["old_logps"])[mask]
    assert difference.max() <= 1e-5, difference.max()
    assert np.abs(rows["old_logps"][mask]).mean() > 0.5, "log-probs this near 0 prove little"
    # A group's samples differ (each its own key).
    completions = rows["target_ids"][:, -8:]
    assert len({tuple(r) for r in completions[:4]}) > 1
    step = run.train_step(rows)
    assert float(step["sampling/logp_difference/mean"]) <= 1e-5


def test_a_rollouts_key_decides_its_tokens(tmp_path):
    run = helpers.engine(helpers.sums_file(tmp_path / "sums.jsonl"), grpo=_grpo())
    run.init_or_restore()
    sample = run.config.objective.instantiate().sampler(run, end_ids=(1,))
    prompts = np.tile(np.asarray([[0, 0, 5, 6, 7, 3]], np.int32), (8, 1))
    lengths = np.full((8,), 4, np.int32)
    draws = [np.asarray(sample(run.state.params, prompts, lengths,
                               jax.random.PRNGKey(k))["tokens"]) for k in (3, 3, 4)]
    np.testing.assert_array_equal(draws[0], draws[1])
    assert (draws[0] != draws[2]).any()
    # Between rollouts the engine holds neither pools nor params: the train steps have that
    # memory.
    assert sample.engine.pools is None and sample.engine.params is None


@pytest.mark.parametrize("changes,match", [
    ({"slots": 2}, "objective.decoding.slots"),
    ({"block_size": 0}, "decoding.block_size"),
    ({"pool_tokens": 0}, "decoding.pool_tokens")])
def test_engine_sizes_it_cannot_serve_are_refused_by_name(tmp_path, changes, match):
    with pytest.raises(errors.TitanaxError, match=match):
        run = helpers.engine(helpers.sums_file(tmp_path / "sums.jsonl"), grpo=_grpo(**changes))
        run.init_or_restore()
        next(run._configured_iterator())  # pylint: disable=protected-access


@pytest.mark.parametrize("layout,kv_heads", [("dp", 2), ("dp_tp", 1)])
def test_compile_only_sizes_the_engines_pool_in_tokens(tmp_path, layout, kv_heads):
    """``--compile_only``'s figures for the engine, nothing allocated: the pool per batch shard
    in tokens (by default every rollout row of a shard at its longest: 4 rows x 16 tokens) and
    per device in bytes (its kv heads: all under DP, half under TP), the decode chunk compiled
    at every slot."""
    from titanax.train import abstract_compile  # pylint: disable=import-outside-toplevel
    run = helpers.engine(helpers.sums_file(tmp_path / "sums.jsonl"), layout=layout,
                         grpo=_grpo())
    report = abstract_compile.compile_only(run)
    rows_per_shard = 8 * 4 // (4 if layout == "dp_tp" else 8)
    assert report["decode_slots"] == rows_per_shard
    assert report["decode_pool_tokens"] == rows_per_shard * 16
    # tokens x kv heads x head_dim 8 x (keys, values) x 2 layers x 4 bytes.
    assert report["decode_pool_bytes"] == rows_per_shard * 16 * kv_heads * 8 * 2 * 2 * 4
    assert report["sampler_temp_bytes"] > 0
    assert report["rollout_peak_bytes"] == report["argument_bytes"] + \
        report["decode_pool_bytes"] + report["sampler_temp_bytes"]
