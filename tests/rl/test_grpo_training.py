"""GRPO through the engine: every variant training, LoRA with the KL to its base, several
updates per rollout, resuming bit-identically, and what is refused (``llama_tiny_grpo``
learning with its defaults: test_grpo_launch.py)."""

import jax
import numpy as np
import pytest

from tests.numerics import assert_identical
from tests.rl import helpers
from titanax import errors
from titanax.data.pipeline import Input
from titanax.data.prompts import Prompts
from titanax.modules.lora import LoRA
from titanax.modules.models.language_model import REFERENCE
from titanax.modules.preference import Preference
from titanax.parallel.context_parallel import CP
from titanax.parallel.plan import DP, Plan
from titanax.rl.grpo import GRPO
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
    from titanax.io.checkpointer import OrbaxCheckpoint  # pylint: disable=import-outside-toplevel
    files = helpers.sums_file(tmp_path / "s.jsonl")

    def engine(name):
        return helpers.engine(files, checkpoint=OrbaxCheckpoint.default_config().set(
            path=str(tmp_path / name)), learner=helpers.helpers.adam(1e-2))

    straight = engine("straight")
    straight.fit(steps=4)
    first = engine("resumed")
    first.fit(steps=2)
    first.close()
    second = engine("resumed")
    second.fit(steps=4)
    assert second.restored_from.endswith("/2")
    assert [h["reward"] for h in second.history] == [h["reward"] for h in
                                                     straight.history[2:]]
    assert_identical(jax.device_get(second.state.params), jax.device_get(straight.state.params))


def test_what_grpo_refuses(tmp_path):
    files = helpers.sums_file(tmp_path / "s.jsonl")
    with pytest.raises(errors.ConfigError, match="one objective") as info:
        helpers.engine(files, preference=Preference.default_config()).build()
    assert info.value.path == "grpo"
    with pytest.raises(errors.ConfigError, match="no RL objective") as info:
        helpers.engine(files, grpo=None).build()
    assert info.value.path == "train_input.source"
    with pytest.raises(errors.ConfigError, match="max_seq_len 24") as info:
        helpers.engine(files, grpo=GRPO.default_config().set(
            max_new_tokens=20, rewards={"a": AnswerMatch.default_config()})).build()
    assert info.value.path == "grpo.max_new_tokens"
    with pytest.raises(errors.PlanError, match="whole") as info:
        helpers.engine(files, mesh=helpers.helpers.mesh((2, 4), ("data", "context")),
                       plan=Plan.default_config().set(
                           data_parallel=DP.default_config(),
                           context_parallel=CP.default_config().set(axis="context"))).build()
    assert info.value.path == "plan.context_parallel"
    with pytest.raises(errors.ConfigError, match="no held-out loss") as info:
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
