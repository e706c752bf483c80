"""Tool calls read out of an assistant turn in each format, and answered
(titanax/agents/tool_calls.py): a well-formed call runs its tool; a malformed one, an unknown
tool, wrong arguments or a tool that raises each get an error message the model reads."""

import json

from titanax.agents.tool_calls import ToolCall, answer, parse_tool_calls
from tests.agents import tools

TOOLS = {"add": tools.add, "failing": tools.failing}


def test_hermes_turns_hold_any_number_of_calls():
    text = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3.5}}\n'
            '</tool_call>\n<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert parse_tool_calls(text, style="hermes") == [
        ToolCall("add", {"a": 2, "b": 3.5}), ToolCall("add", {"a": 1})]
    assert parse_tool_calls("The answer is 4.", style="hermes") == []


def test_llama3_turns_are_one_json_call():
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert parse_tool_calls(text, style="llama3") == [ToolCall("add", {"a": 1, "b": 2})]
    assert parse_tool_calls('{"name": "add", "parameters": {"a": 1}}', style="llama3") == [
        ToolCall("add", {"a": 1})]
    assert parse_tool_calls("It is 3.", style="llama3") == []


def test_malformed_calls_are_calls_with_an_error():
    broken, nameless, listed = (parse_tool_calls(f"<tool_call>{body}</tool_call>",
                                                 style="hermes")[0]
                                for body in ('{"name": "add", ', '{"arguments": {}}',
                                             '{"name": "add", "arguments": [1, 2]}'))
    assert broken.error.startswith("the tool call is not JSON")
    assert "with a \"name\"" in nameless.error
    assert listed.name == "add" and "is a JSON object" in listed.error


def test_each_call_is_answered_by_its_tool_or_with_the_error_the_model_made():
    assert answer(ToolCall("add", {"a": 2, "b": 3.5}), TOOLS) == {
        "role": "tool", "name": "add", "content": json.dumps(5.5)}
    failures = {
        "unknown": answer(ToolCall("sub", {"a": 1}), TOOLS),
        "arguments": answer(ToolCall("add", {"c": 1}), TOOLS),
        "raises": answer(ToolCall("failing", {"x": 2}), TOOLS),
        "malformed": answer(ToolCall(None, {}, error="the tool call is not JSON"), TOOLS)}
    assert all(m["role"] == "tool" and m["error"] and m["content"].startswith("Error: ")
               for m in failures.values())
    assert "there is no tool 'sub'; the tools are add, failing" in failures["unknown"]["content"]
    assert "add cannot take these arguments" in failures["arguments"]["content"]
    assert "failing failed: ValueError: no 2" in failures["raises"]["content"]
