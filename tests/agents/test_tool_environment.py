"""The common environment (titanax/agents/tool_environment.py): calls answered by the tools,
a malformed call answered with its error, a plain turn scored as the answer -- and the bundled
calculator built on it (titanax/agents/calculator.py)."""

import json

import pytest

from titanax.agents import calculator
from titanax.agents.environment import checked_step
from titanax.agents.tool_environment import ToolEnvironment
from tests.agents import tools


class Adder(ToolEnvironment):
    tools = (tools.add, tools.failing)


def _said(text):
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]


def test_calls_are_answered_and_a_plain_turn_is_scored():
    env = Adder()
    assert env.reset({"prompt": "What is 2 + 3?", "answer": "5"}) == [
        {"role": "user", "content": "What is 2 + 3?"}]
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    messages, reward, done = checked_step(env.step(_said(call)), said_by="Adder.step")
    assert (messages, reward, done) == ([{"role": "tool", "name": "add", "content": "5"}],
                                        0.0, False)
    # Two calls in a turn, one malformed and one the tool refuses: each answered, marked failed.
    turn = ('<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>'
            '<tool_call>{"name": "failing", "arguments": {"x": 4}}</tool_call>')
    messages, reward, done = env.step(_said(turn))
    assert [m.get("error") for m in messages] == [True, True] and not done
    assert "not JSON" in messages[0]["content"] and "ValueError: no 4" in messages[1]["content"]
    assert env.step(_said("It is 5."))[1:] == (1.0, True)
    assert env.step(_said("It is 6."))[1:] == (0.0, True)
    assert env.step(_said("I do not know."))[1:] == (0.0, True)


def test_a_conversational_record_opens_with_its_own_messages():
    opening = [{"role": "system", "content": "Add."}, {"role": "user", "content": "2 + 3?"}]
    assert Adder().reset({"prompt": opening, "answer": "5"}) == opening


def test_a_tool_environment_without_tools_reads_every_turn_as_the_answer():
    env = ToolEnvironment()
    env.reset({"prompt": "q", "answer": "1"})
    assert env.step(_said('<tool_call>{"name": "add"}</tool_call> 1')) == ([], 1.0, True)


def test_the_calculator_calls_on_the_records_operands_and_scores_digits_in_place():
    record = {"prompt": "123+356=", "a": 123, "b": 356, "answer": "479"}
    env = calculator.Calculator()
    env.reset(record)
    messages, reward, done = env.step(_said(calculator.CALL))
    assert (messages, reward, done) == ([{"role": "tool", "name": "add", "content": "479"}],
                                        0.0, False)
    assert env.step(_said(calculator.CALL))[1] == 0.0  # (A call earns at the answer.)
    assert env.step(_said("479")) == ([], pytest.approx(1.0), True)
    assert env.step(_said("409"))[1] == pytest.approx(0.2 + 0.8 * 2 / 3)
    assert env.step(_said("4790"))[1] == pytest.approx(0.2 + 0.8 * 3 / 4)
    assert env.step(_said("+"))[1] == pytest.approx(0.2)
    env.reset(record)  # (A new episode: no call yet.)
    assert env.step(_said("479"))[1] == pytest.approx(0.8)
    assert env.step(_said("470"))[1] == pytest.approx(0.8 * 2 / 3)
    bare = calculator.NoCalculator()
    bare.reset(record)
    assert bare.step(_said(calculator.CALL)) == ([], 0.0, True)
    assert bare.tools == ()


def test_the_bundled_data_is_what_write_bundled_writes(tmp_path):
    calculator.write_bundled(str(tmp_path))
    from titanax.data import bundled  # pylint: disable=import-outside-toplevel
    shipped = bundled.resolve("bundled:calculator")
    for name in ("tokenizer.json", "tokenizer_config.json", "prompts.jsonl"):
        with open(tmp_path / name, encoding="utf-8") as mine, \
                open(f"{shipped}/{name}", encoding="utf-8") as theirs:
            assert mine.read() == theirs.read(), name
    with open(tmp_path / "prompts.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert len(records) == calculator.PROMPTS
    for record in records:
        assert 0 <= record["a"] and 0 <= record["b"] and 100 <= record["a"] + record["b"] < 1000
        assert record["prompt"] == f"{record['a']}+{record['b']}=" and \
            record["answer"] == str(record["a"] + record["b"]) and len(record["answer"]) == 3
