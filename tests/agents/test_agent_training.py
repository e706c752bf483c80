"""The agent objective through the engine (titanax/objectives/agent.py): episodes played with a
user's environment become rows whose trained tokens are exactly the model's sampled turns --
their training log-probs the sampler's under DP, TP and FSDP, no gradient at the environment's
tokens --, a run resumes bit-identically, and what cannot work is refused by its config path
before step 1 (``llama_tiny_agent`` itself: test_agent_launch.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.numerics import assert_identical
from tests.rl import helpers as rl_helpers
from tests.train import helpers
from titanax import errors
from titanax.data.pipeline import Input
from titanax.data.prompts import Prompts
from titanax.decoding.rollout_sampler import PagedDecoding
from titanax.modules.models.decoder import Decoder
from titanax.objectives.agent import Agent
from titanax.parallel.plan import DP, Plan
from titanax.rl.rewards import AnswerMatch
from titanax.train.engine import Engine

CALCULATOR = "bundled:calculator"
MODEL = dict(name="llama", vocab_size=20, max_seq_len=40, num_layers=2, model_dim=32,
             num_heads=4, num_kv_heads=2, hidden_dim=48)
ENVIRONMENTS = "tests.agents.environments"


def agent_engine(*, layout="dp", environment="Digits", checkpoint=None, tokenizer=CALCULATOR,
                 **agent) -> Engine:
    """An agent run on the bundled calculator's prompts and tokenizer (20 ids): 8 records x 4
    episodes a step, up to 3 turns of 5 tokens, 28 tokens an episode, temperature 0.8."""
    shape, axes, plan = rl_helpers.LAYOUTS[layout]
    prompts = Input.default_config().set(
        source=Prompts.default_config().set(files=[f"{CALCULATOR}/prompts.jsonl"],
                                            max_prompt_tokens=12),
        global_batch_size=8)
    prompts.tokenizer.path = tokenizer
    objective = Agent.default_config().set(
        environment=f"{ENVIRONMENTS}.{environment}", max_turns=3, max_tokens=28,
        max_new_tokens=5, num_generations=4, temperature=0.8).set(**agent)
    cfg = Engine.default_config().set(
        mesh=helpers.mesh(shape, axes),
        plan=Plan.default_config().set(data_parallel=DP.default_config(), **plan),
        model=Decoder.default_config().set(**MODEL), train_input=prompts, objective=objective,
        learner=helpers.adam(1e-2), loggers=[], log_every=1, max_steps=4)
    if checkpoint is not None:
        cfg.checkpoint = checkpoint
    return cfg.instantiate()


def _spans(trained_row: np.ndarray) -> int:
    """The runs of trained targets in a row (one per assistant turn)."""
    return int(np.sum(np.diff(np.concatenate([[0], trained_row.astype(int)])) == 1))


@pytest.mark.parametrize("layout", sorted(rl_helpers.LAYOUTS))
def test_rows_are_the_episodes_and_train_on_the_samplers_log_probs(layout):
    engine = agent_engine(layout=layout)
    engine.init_or_restore()
    stream = engine._configured_iterator()  # pylint: disable=protected-access
    rows, metrics = next(stream)
    episodes = stream.episodes
    assert len(episodes) == len(rows["input_ids"]) == 32
    for row, episode in enumerate(episodes):  # Rows = trajectories, left-padded, shifted.
        ids, trained, logps = episode.trajectory.arrays()
        width = len(ids) - 1
        np.testing.assert_array_equal(rows["input_ids"][row, -width:], ids[:-1])
        np.testing.assert_array_equal(rows["target_ids"][row, -width:], ids[1:])
        np.testing.assert_array_equal(rows["weights"][row, -width:] > 0, trained[1:])
        np.testing.assert_array_equal(rows["old_logps"][row, -width:][trained[1:]],
                                      logps[1:][trained[1:]])
        assert not rows["weights"][row, :-width].any()
    mask = rows["weights"] > 0
    turns = [_spans(row) for row in mask]
    assert max(turns) == 3 and min(turns) >= 1, turns  # (Some end early: a turn with no end.)
    # Between turns: the environment's tokens (<tool>, two digits, <assistant>), untrained.
    for row, count in zip(mask, turns):
        inside = row[np.argmax(row):len(row) - np.argmax(row[::-1])]
        assert (~inside).sum() == 4 * (count - 1)
    assert sum(count > 1 for count in turns) >= 4, turns
    trained = rl_helpers.recomputed_logps(engine, engine.state.params, rows)
    difference = np.abs(trained - rows["old_logps"])[mask]
    assert difference.max() <= 1e-5, difference.max()
    assert np.abs(rows["old_logps"][mask]).mean() > 0.5, "log-probs this near 0 prove little"
    assert metrics["turns/mean"] == pytest.approx(np.mean(turns))
    assert metrics["reward"] == pytest.approx(np.mean([e.reward for e in episodes]))
    out = engine.train_step(rows)
    assert float(out["sampling/logp_difference/mean"]) <= 1e-5


def test_the_environments_tokens_get_no_gradient():
    """The loss's gradient with respect to each target's log-prob is exactly 0 at every
    environment / template token (and not at the model's); and a row whose environment tokens
    are other ids trains to the same loss, bit for bit."""
    engine = agent_engine()
    engine.init_or_restore()
    stream = engine._configured_iterator()  # pylint: disable=protected-access
    rows, _ = next(stream)
    objective = engine.objective
    exact = {k: jnp.asarray(rows[k]) for k in ("old_logps", "advantages", "weights",
                                              "row_weights")}
    assert np.abs(rows["advantages"]).max() > 0, "no advantage: no gradient anywhere"

    def loss(logps):
        return objective.policy_loss(logps=logps, old_logps=exact["old_logps"],
                                     advantages=exact["advantages"], mask=exact["weights"],
                                     row_weights=exact["row_weights"]).loss
    moved = exact["old_logps"] - 0.1 * jnp.asarray(rows["weights"])  # (Inside the clip.)
    gradient = np.asarray(jax.grad(loss)(moved))
    untrained = rows["weights"] == 0
    assert (gradient[untrained] == 0).all()
    assert (gradient[~untrained] != 0).sum() > 0.5 * (~untrained).sum()
    other = dict(rows)
    other["target_ids"] = np.where(untrained, (rows["target_ids"] + 7) % 20,
                                   rows["target_ids"]).astype(np.int32)
    assert (other["target_ids"] != rows["target_ids"]).any()
    model_loss = jax.jit(lambda params, batch: objective.loss(
        engine.model, params, batch, key=None, is_training=False)[0][0])
    params = jax.device_get(engine.state.params)
    losses = [model_loss(params, {k: jnp.asarray(v) for k, v in batch.items()})
              for batch in (rows, other)]
    assert float(losses[0]) == float(losses[1])
    changed = dict(rows, target_ids=np.where(untrained, rows["target_ids"],
                                             (rows["target_ids"] + 7) % 20).astype(np.int32))
    assert float(model_loss(params, {k: jnp.asarray(v) for k, v in changed.items()})) != \
        float(losses[0])  # (The model's own targets do count.)


def test_an_agent_run_resumes_bit_identically(tmp_path):
    straight, second = helpers.straight_and_resumed(
        lambda checkpoint: agent_engine(checkpoint=checkpoint), root=tmp_path)
    assert [h["reward"] for h in second.history] == [h["reward"] for h in
                                                     straight.history[2:]]
    assert_identical(jax.device_get(second.state.params), jax.device_get(straight.state.params))


REFUSALS = [
    (dict(environment="NoSuchClass"), errors.AgentError, "objective.environment",
     "has no class 'NoSuchClass'"),
    (dict(environment="NoStep"), errors.AgentError, "objective.environment",
     r"NoStep has no method step\(\)"),
    (dict(environment="NeedsArguments"), errors.AgentError, "objective.environment",
     "cannot be made without arguments"),
    (dict(tools=["tests.agents.tools.undocumented"]), errors.AgentError, "objective.tools[0]",
     "has no docstring"),
    (dict(tools=["tests.agents.tools.takes_a_point"]), errors.AgentError, "objective.tools[0]",
     "which a call from JSON cannot build"),
    (dict(max_new_tokens=20), errors.ConfigError, "objective.max_new_tokens",
     "max_seq_len 40"),
    (dict(reference_from="/nowhere"), errors.ConfigError, "objective.reference_from",
     "this run has none"),
]


@pytest.mark.parametrize("change,error,path,message", REFUSALS,
                         ids=[str(sorted(r[0].items())) for r in REFUSALS])
def test_what_an_agent_run_refuses_at_build(change, error, path, message):
    environment = change.pop("environment", "Digits")
    with pytest.raises(error, match=message) as info:
        agent_engine(environment=environment, **change).build()
    assert info.value.path == path


def test_what_only_a_call_shows_names_the_environment_and_record():
    for environment, message in (("TwoValues", r"TwoValues.step \(record \S+/calculator/"
                                               r"prompts.jsonl:\d+, sample 0\) returned 2 "
                                               r"values"),
                                 ("NotANumber", r"NotANumber.step \(record \S+/calculator/"
                                                r"prompts.jsonl:\d+, sample 0\) returned the "
                                                r"reward nan")):
        engine = agent_engine(environment=environment)
        engine.init_or_restore()
        with pytest.raises(errors.AgentError, match=message):
            next(engine._configured_iterator())  # pylint: disable=protected-access


def test_config_values_an_agent_refuses():
    problems = {
        "max_turns": dict(max_turns=0), "max_tokens": dict(max_tokens=1),
        "workers": dict(workers=0), "environment": dict(environment=None),
        "reward_functions": dict(rewards={"a": AnswerMatch.default_config()}),
        "decoding": dict(decoding=PagedDecoding.default_config()),
        "max_staleness": dict(max_staleness=1), "end_ids": dict(end_ids=[2])}
    for path, change in problems.items():
        cfg = Agent.default_config().set(environment="x.Y").set(**change)
        with pytest.raises(errors.ConfigValidationError) as info:
            cfg.instantiate()
        assert [p.path for p in info.value.problems] == [path], (path, info.value)
    Agent.default_config().set(environment="x.Y").instantiate()  # (No reward needed.)


def test_a_chat_template_that_never_ends_a_turn_is_refused_before_step_1(tmp_path):
    import json
    import shutil
    from titanax.data import bundled
    shutil.copy(f"{bundled.resolve(CALCULATOR)}/tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "<end>",
         "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    engine = agent_engine(tokenizer=str(tmp_path))
    engine.init_or_restore()
    with pytest.raises(errors.AgentError, match="writes no special token after") as info:
        engine._configured_iterator()  # pylint: disable=protected-access
    assert info.value.path == "train_input.tokenizer"
