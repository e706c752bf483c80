"""GRPO through the engine: every variant training, LoRA with the KL to its base, several
updates per rollout, resuming bit-identically, a gamed reward seen in the samples, and what is
refused (``llama_tiny_grpo`` learning with its defaults: test_grpo_launch.py)."""

import json

import jax
import numpy as np
import pytest

from tests.numerics import assert_close, assert_identical, float64_numerics
from tests.rl import helpers
from titanax import errors
from titanax.data.pipeline import Input
from titanax.data.prompts import Prompts
from titanax.modules.lora import LoRA
from titanax.parallel.context_parallel import CP
from titanax.parallel.plan import DP, Plan
from titanax.modules.models.decoder import Decoder
from titanax.objectives.grpo import GRPO, REFERENCE
from titanax.objectives.preference import Preference
from titanax.rl.rewards import AnswerMatch, LengthPenalty
from titanax.train.evaler import Evaler


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_every_variant_trains(tmp_path, loss):
    grpo = GRPO.default_config().set(
        loss=loss, num_generations=4, max_new_tokens=4, beta=0.04 if loss == "grpo" else 0.0,
        rewards={"answer": AnswerMatch.default_config(),
                 "short": LengthPenalty.default_config().set(free_tokens=2, weight=0.5)})
    engine = helpers.engine(helpers.sums_file(tmp_path / "s.jsonl"), grpo=grpo,
                            layout="dp_tp")
    engine.fit(steps=3)
    last = engine.history[-1]
    assert np.isfinite(last["loss"]) and last["grad_norm"] > 0
    for name in ("reward", "reward_std", "rewards/answer/mean", "rewards/short/std",
                 "entropy", "completions/mean_length", "clip_ratio/region_mean",
                 "time/rollout_s", "time/train_s", "rollout/tokens_per_s"):
        assert name in last, name
    assert ("kl" in last) == (loss == "grpo")
    assert (REFERENCE in engine.state.params) == (loss == "grpo")
    if loss == "dapo":
        assert "aux/num_tokens" in last  # A token-level mean: shards weighed by their tokens.


def test_lora_takes_the_kl_to_its_base_and_holds_no_copy(tmp_path):
    grpo = GRPO.default_config().set(
        num_generations=4, max_new_tokens=4, beta=0.1,
        rewards={"short": LengthPenalty.default_config().set(free_tokens=1)})
    engine = helpers.engine(helpers.sums_file(tmp_path / "s.jsonl"), grpo=grpo,
                            lora=LoRA.default_config().set(rank=4),
                            learner=helpers.helpers.adam(1e-2))
    engine.fit(steps=4)
    assert REFERENCE not in engine.state.params
    kls = [h["kl"] for h in engine.history]
    assert kls[0] == 0.0 and kls[-1] > 0.0, kls  # (Adapters start at 0: policy = base.)


def test_each_rollout_feeds_its_updates_with_its_own_log_probs(tmp_path):
    """updates_per_rollout=2, iterations=2: a rollout every 4 steps; its first update sees the
    sampler's log-probs (no difference), the later ones a moved policy."""
    grpo = GRPO.default_config().set(
        num_generations=4, max_new_tokens=4, updates_per_rollout=2, iterations=2,
        rewards={"short": LengthPenalty.default_config().set(free_tokens=1)})
    engine = helpers.engine(helpers.sums_file(tmp_path / "s.jsonl"), grpo=grpo,
                            learner=helpers.helpers.adam(1e-2))
    engine.fit(steps=8)
    stream = engine._configured_iterator()  # pylint: disable=protected-access
    assert stream.rollouts == 2
    differences = [h["sampling/logp_difference/mean"] for h in engine.history]
    assert differences[0] <= 1e-5 and differences[4] <= 1e-5, differences
    assert min(differences[2], differences[3], differences[6]) > 1e-4, differences


def test_a_grpo_run_resumes_bit_identically(tmp_path):
    files = helpers.sums_file(tmp_path / "s.jsonl")
    straight, second = helpers.helpers.straight_and_resumed(
        lambda checkpoint: helpers.engine(files, checkpoint=checkpoint,
                                          learner=helpers.helpers.adam(1e-2)), root=tmp_path)
    assert [h["reward"] for h in second.history] == [h["reward"] for h in
                                                     straight.history[2:]]
    assert_identical(jax.device_get(second.state.params), jax.device_get(straight.state.params))


def test_what_grpo_refuses(tmp_path):
    files = helpers.sums_file(tmp_path / "s.jsonl")
    with pytest.raises(errors.ConfigError, match="trains on preference pairs") as info:
        helpers.engine(files, grpo=Preference.default_config()).build()
    assert info.value.path == "train_input.source"
    with pytest.raises(errors.ConfigError, match="trains on plain rows") as info:
        helpers.engine(files, grpo=None).build()
    assert info.value.path == "train_input.source"
    with pytest.raises(errors.ConfigError, match="max_seq_len 24") as info:
        helpers.engine(files, grpo=GRPO.default_config().set(
            max_new_tokens=20, rewards={"a": AnswerMatch.default_config()})).build()
    assert info.value.path == "objective.max_new_tokens"
    with pytest.raises(errors.PlanError, match="whole") as info:
        helpers.engine(files, mesh=helpers.helpers.mesh((2, 4), ("data", "context")),
                       plan=Plan.default_config().set(
                           data_parallel=DP.default_config(),
                           context_parallel=CP.default_config().set(axis="context"))).build()
    assert info.value.path == "plan.context_parallel"
    with pytest.raises(errors.ConfigError, match="by a held-out loss") as info:
        helpers.engine(files, evalers={"heldout": Evaler.default_config().set(
            input=Input.default_config().set(source=Prompts.default_config().set(
                files=[files]), global_batch_size=8))}).build()
    assert info.value.path == "evalers"
    with pytest.raises(errors.ConfigValidationError, match="no reward"):
        GRPO.default_config().instantiate()


def test_compile_only_sizes_the_train_step_and_the_rollout(tmp_path):
    """--compile_only compiles the train step on rollout rows (prompt + completion, a group per
    prompt) and the sampler on top of the train state: its key/value cache grows with the
    completion budget."""
    from titanax.train import abstract_compile  # pylint: disable=import-outside-toplevel
    files = helpers.sums_file(tmp_path / "s.jsonl")
    reports = {}
    for budget in (4, 12):
        grpo = GRPO.default_config().set(num_generations=4, max_new_tokens=budget,
                                         rewards={"a": AnswerMatch.default_config()})
        reports[budget] = abstract_compile.compile_only(helpers.engine(files, grpo=grpo))
    for report in reports.values():
        assert report["rollout_peak_bytes"] > report["sampler_temp_bytes"] > 0
        assert report["peak_bytes"] >= report["rollout_peak_bytes"]
    assert reports[12]["sampler_temp_bytes"] > reports[4]["sampler_temp_bytes"]
    assert reports[12]["temp_bytes"] > reports[4]["temp_bytes"]


@pytest.mark.parametrize("loss", ["grpo", "dapo"])
def test_a_step_on_eight_shards_equals_one_device(tmp_path, loss):
    """The same rollout rows (completions of different lengths, some groups dropped) trained
    on data=8 and on one device: the same SGD update -- each shard's loss a mean over its own
    rows (GRPO) or tokens (DAPO), weighed back to the whole batch's mean."""
    from titanax.train import precision as precision_lib  # pylint: disable=import-outside-toplevel
    files = helpers.sums_file(tmp_path / "s.jsonl")
    grpo = GRPO.default_config().set(
        loss=loss, num_generations=4, max_new_tokens=6, drop_equal_groups=True,
        rewards={"short": LengthPenalty.default_config().set(free_tokens=2)})
    f64 = precision_lib.Precision.default_config().set(float64=True)
    with float64_numerics():
        eight = helpers.engine(files, grpo=grpo, precision=f64,
                               learner=helpers.helpers.sgd(0.5))
        one = helpers.engine(files, grpo=grpo, precision=f64, learner=helpers.helpers.sgd(0.5),
                             mesh=helpers.helpers.mesh((1,), ("data",), devices=[0]))
        eight.init_or_restore()
        one.init_or_restore()
        rows, _ = next(eight._configured_iterator())  # pylint: disable=protected-access
        lengths = rows["weights"].sum(axis=1)
        assert len(set(lengths.tolist())) > 1 and 0 < rows["row_weights"].mean() < 1, rows
        eight.train_step(rows)
        one.train_step(rows)
        assert_close(jax.device_get(eight.state.params), jax.device_get(one.state.params),
                     what=f"{loss} params after a step")


def test_exact_fields_stay_float32_under_bfloat16():
    from titanax.train.gradients import ModelGradients  # pylint: disable=import-outside-toplevel
    from titanax.train.precision import Precision  # pylint: disable=import-outside-toplevel
    objective = GRPO.default_config().set(
        rewards={"a": AnswerMatch.default_config()}).instantiate()
    computer = ModelGradients(model=None, mesh_shape={},
                              precision=Precision.default_config().set(
                                  bfloat16=True).instantiate(),
                              objective=objective)
    batch = {"old_logps": np.full((2, 3), -2.3, np.float32), "advantages": np.ones(2, np.float32),
             "input_ids": np.zeros((2, 3), np.int32), "other": np.ones(2, np.float32)}
    cast = computer.compute_inputs(batch)
    assert cast["old_logps"].dtype == np.float32 and cast["advantages"].dtype == np.float32
    assert cast["other"].dtype == jax.numpy.bfloat16


def test_checkpoints_wait_for_the_end_of_a_rollout_and_resume_exactly(tmp_path):
    """Two updates per rollout, a save due every 3 steps: saved at 4 and 6 (rollout ends), and
    a run resumed from 4 equals the uninterrupted one."""
    from titanax.io.checkpointer import OrbaxCheckpoint  # pylint: disable=import-outside-toplevel
    files = helpers.sums_file(tmp_path / "s.jsonl")
    grpo = GRPO.default_config().set(
        num_generations=4, max_new_tokens=4, updates_per_rollout=2,
        rewards={"short": LengthPenalty.default_config().set(free_tokens=1)})

    def engine(name, steps):
        return helpers.engine(files, grpo=grpo, learner=helpers.helpers.adam(1e-2),
                              max_steps=steps, checkpoint=OrbaxCheckpoint.default_config().set(
                                  path=str(tmp_path / name), save_every_n_steps=3,
                                  keep_last_n=10))

    straight = engine("straight", 8)
    straight.fit()
    straight.close()
    assert straight.checkpointer().all_steps() == [4, 6, 8]
    first = engine("resumed", 4)
    first.fit()
    first.close()
    assert first.checkpointer().all_steps() == [4]
    second = engine("resumed", 8)
    second.fit()
    assert [h["reward"] for h in second.history] == [h["reward"] for h in
                                                     straight.history[-len(second.history):]]
    assert_identical(jax.device_get(second.state.params), jax.device_get(straight.state.params))


def test_more_refusals(tmp_path):
    files = helpers.sums_file(tmp_path / "s.jsonl")
    grpo = dict(num_generations=4, rewards={"a": AnswerMatch.default_config()})
    with pytest.raises(errors.ConfigError, match="do not split into 3 updates") as info:
        helpers.engine(files, grpo=GRPO.default_config().set(updates_per_rollout=3,
                                                             **grpo)).build()
    assert info.value.path == "objective.updates_per_rollout"
    with pytest.raises(errors.ConfigError, match="no token id") as info:
        helpers.engine(files, grpo=GRPO.default_config().set(end_ids=[2, 99], **grpo)).build()
    assert info.value.path == "objective.end_ids[1]"
    with pytest.raises(errors.RewardError, match="cannot import") as info:
        helpers.engine(files, grpo=GRPO.default_config().set(
            reward_functions=["no_such_module.fn"], **grpo)).build()
    assert info.value.path == "objective.reward_functions[0]"
    with pytest.raises(errors.ConfigError, match="beta 0") as info:
        helpers.engine(files, grpo=GRPO.default_config().set(reference_from=files,
                                                             **grpo)).build()
    assert info.value.path == "objective.reference_from"
    with pytest.raises(errors.ConfigError, match="capacity-limited") as info:
        from titanax.modules.layers.moe import MoE  # pylint: disable=import-outside-toplevel
        helpers.engine(files, model=Decoder.default_config().set(
            **helpers.MODEL, moe=MoE.default_config().set(hidden_dim=32, num_experts=4,
                                                          dispatch="capacity"))).build()
    assert info.value.path == "model.moe.dispatch"
    padded = helpers.engine(files).config.train_input.clone(last_batch="pad")
    with pytest.raises(errors.ConfigError, match="padding rows") as info:
        helpers.engine(files, train_input=padded).build()
    assert info.value.path == "train_input.last_batch"
    engine = helpers.engine(files)
    with pytest.raises(errors.StepError, match="makes its batches") as info:
        engine.fit(data=[{}], steps=1)
    assert info.value.path == "fit(data=...)"


def test_a_completion_that_games_the_reward_shows_in_the_samples_at_its_step(tmp_path, capsys):
    """A reward a degenerate completion games (the share of 7s, whatever the sum): within 30
    steps the policy prints only 7s, and samples.jsonl and the console show it at the step it
    is sampled -- not only after the run."""
    from tests.train import helpers as train_helpers  # pylint: disable=import-outside-toplevel
    from titanax.train.engine import Engine  # pylint: disable=import-outside-toplevel
    cfg = helpers.engine(helpers.sums_file(tmp_path / "sums.jsonl"), max_steps=30,
                         learner=train_helpers.adam(1e-2)).config.clone()
    cfg.objective = GRPO.default_config().set(
        num_generations=4, max_new_tokens=4, temperature=1.0, samples_every=10,
        reward_functions=["tests.rl.gamed_rewards.sevens"])
    Engine(cfg, trainer_dir=str(tmp_path / "run")).fit()
    with open(tmp_path / "run" / "samples.jsonl", encoding="utf-8") as f:
        samples = [json.loads(line) for line in f]
    assert sorted({e["step"] for e in samples}) == [1, 10, 20, 30]
    assert not any(e["completion"] == "7777" for e in samples if e["step"] == 1)
    gamed = [e for e in samples if e["completion"] == "7777"]
    assert gamed and all(e["reward"] == 1.0 for e in gamed), samples
    console = capsys.readouterr().out
    at = console.index(f"samples at step {gamed[0]['step']} (2 of 32 completions):")
    assert 'completion "7777"' in console[at:].split("samples at step")[1], console[at:at + 400]
