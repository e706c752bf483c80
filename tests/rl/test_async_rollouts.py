"""Asynchronous GRPO (``objective.max_staleness``; rl/rollouts_ahead.py): with a staleness of 1
the rollout step n trains on was sampled with the params of step n - 1 (its log-probs are those
params', not the current ones'), sampled on a worker thread while step n - 1 trained; the train
step reports the lag; a checkpoint keeps the rollout sampled ahead whole, so a
resumed stream trains on what the uninterrupted one did -- through the launcher too, a run
stopped and resumed gives the uninterrupted run's rewards; a negative staleness is refused by
name before any step."""

import csv
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from tests.commands import run_module
from tests.rl import helpers
from titanax.objectives.grpo import GRPO
from titanax.rl.rewards import LengthPenalty


def _grpo():
    """A length penalty: a random policy's completions differ in it, so every step learns
    (a reward all equal would leave the params as they were, and staleness unseen)."""
    return GRPO.default_config().set(num_generations=4, max_new_tokens=8, temperature=0.8,
                                     rewards={"length": LengthPenalty.default_config()},
                                     max_staleness=1)


def _copy(params):
    return jax.tree_util.tree_map(jnp.copy, params)


def test_each_rollout_is_sampled_with_the_previous_steps_params_and_resumes_whole(tmp_path):
    sums = helpers.sums_file(tmp_path / "sums.jsonl")
    run = helpers.engine(sums, grpo=_grpo(), max_steps=4)
    run.init_or_restore()
    stream = run._configured_iterator()  # pylint: disable=protected-access
    before = [_copy(run.state.params)]
    handed = []
    for _ in range(3):
        rows, _ = next(stream)
        handed.append(rows)
        metrics = run.train_step(rows)
        before.append(_copy(run.state.params))
    # The train step sees how far the sampler lagged (its log-probs against the policy's).
    assert float(metrics["sampling/logp_difference/mean"]) > 1e-5
    mask = [rows["weights"] > 0 for rows in handed]
    # Rollout 0: the first params (no earlier ones); rollout n > 0: the params before step n.
    for n, sampled_with in ((0, 0), (1, 0), (2, 1)):
        own = np.abs(helpers.recomputed_logps(run, before[sampled_with], handed[n])
                     - handed[n]["old_logps"])
        assert own[mask[n]].max() <= 1e-5, (n, own[mask[n]].max())
    for n in (1, 2):  # (The params each step trains: these rollouts are theirs' elders.)
        current = np.abs(helpers.recomputed_logps(run, before[n], handed[n])
                         - handed[n]["old_logps"])
        assert current[mask[n]].max() > 1e-4, (n, "the step's own params: proves nothing")

    # Saved (rollout 3 sampled ahead, whole) and resumed into a fresh stream: the same rows.
    state = json.loads(json.dumps(stream.get_state()))
    assert len(state["ahead"]) == 1
    want, _ = next(stream)
    fresh = helpers.engine(sums, grpo=_grpo(), max_steps=4)
    fresh.init_or_restore()
    resumed = fresh._configured_iterator()  # pylint: disable=protected-access
    resumed.set_state(state)
    got, _ = next(resumed)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _rewards(trainer_dir):
    with open(os.path.join(trainer_dir, "metrics.csv"), encoding="utf-8") as f:
        return {int(r["step"]): float(r["reward"]) for r in csv.DictReader(f) if r.get("reward")}


def test_a_stopped_and_resumed_run_gives_the_uninterrupted_rewards(tmp_path):
    common = ["--config=llama_tiny_grpo", "--cpu_devices=8", "--config.objective.max_staleness=1",
              "--config.objective.samples_every=0"]
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    run_module("titanax.launch", *common, f"--trainer_dir={whole}", "--config.max_steps=12")
    run_module("titanax.launch", *common, f"--trainer_dir={parts}", "--config.max_steps=6")
    run_module("titanax.launch", *common, f"--trainer_dir={parts}", "--config.max_steps=12")
    want, got = _rewards(whole), _rewards(parts)
    assert sorted(got) == sorted(want) == list(range(1, 13))
    assert [got[s] for s in range(1, 13)] == [want[s] for s in range(1, 13)]
    assert len(set(want.values())) > 3, "rewards this uniform prove little"


def test_a_negative_staleness_is_refused_by_name(tmp_path):
    result = run_module("titanax.launch", "--config=llama_tiny_grpo", "--cpu_devices=8",
                        f"--trainer_dir={tmp_path / 'run'}",
                        "--config.objective.max_staleness=-1", expect=2)
    assert "objective.max_staleness" in result.stderr + result.stdout
