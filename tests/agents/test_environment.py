"""The environment protocol's checks (titanax/agents/environment.py): a class that is not one
is refused by its config path when loaded; a step that returns what the protocol does not say is
an error naming the environment and the record, not a failure inside a rollout."""

import math

import numpy as np
import pytest

from titanax import errors
from titanax.agents.environment import checked_messages, checked_step, load_environment

WHERE = "objective.environment"


def test_a_class_of_the_protocol_loads_and_plays():
    environment = load_environment("tests.agents.environments.Counter", where=WHERE)
    opening = checked_messages(environment.reset({"name": "a"}), said_by="Counter.reset",
                               roles=("system", "user"))
    assert opening == [{"role": "user", "content": "count for a"}]
    assert checked_step(environment.step(opening), said_by="Counter.step") == (
        [{"role": "user", "content": "1"}], 0.5, False)
    assert checked_step(environment.step(opening), said_by="Counter.step")[2] is True


@pytest.mark.parametrize("path,message", [
    ("tests.agents.no_such_module.Env", "cannot import 'tests.agents.no_such_module'"),
    ("tests.agents.environments.Missing", "has no class 'Missing'"),
    ("tests.agents.environments.NOT_A_CLASS", "is a int, not a class"),
    ("tests.agents.environments.NoStep", r"NoStep has no method step\(\)"),
    ("tests.agents.environments.NeedsArguments", r"NeedsArguments\(\) cannot be made"),
    ("Counter", "is no import path")])
def test_what_is_not_an_environment_class_is_refused_by_its_config_path(path, message):
    with pytest.raises(errors.AgentError, match=message) as info:
        load_environment(path, where=WHERE)
    assert info.value.path == WHERE


@pytest.mark.parametrize("result,message", [
    (([], 1.0), "returned 2 values"),
    ("done", "returned str"),
    (({"role": "tool", "content": "x"}, 1.0, True), "returned dict, not a list"),
    (([{"role": "assistant", "content": "x"}], 1.0, True), "message 0 .* role among tool, user"),
    (([{"role": "tool", "content": 3}], 1.0, True), "string content"),
    (([], math.nan, True), "the reward nan"),
    (([], math.inf, False), "the reward inf"),
    (([], "1", False), "the reward '1'"),
    (([], True, False), "the reward True"),
    (([], 1.0, "yes"), "done='yes'")])
def test_a_step_that_breaks_the_protocol_names_the_environment_and_record(result, message):
    said_by = "Counter.step (record 7)"
    with pytest.raises(errors.AgentError, match=message) as info:
        checked_step(result, said_by=said_by)
    assert said_by in str(info.value)


def test_numpy_rewards_and_flags_are_taken_as_python_ones():
    messages, reward, done = checked_step(([], np.float32(0.25), np.bool_(True)), said_by="s")
    assert (messages, reward, done) == ([], 0.25, True)
    assert type(reward) is float and type(done) is bool
