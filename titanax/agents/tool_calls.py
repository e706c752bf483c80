"""Tool calls read out of an assistant turn, and run: the messages that answer them.

Why here and not in the chat template: a template renders calls into text, but what a sampled
turn asks for must be read back from that text, in the style the model was shown. Styles:

- ``hermes`` (Hermes, Qwen 2.5 / 3 / 3.5): each call a JSON object ``{"name", "arguments"}``
  between ``<tool_call>`` and ``</tool_call>``, any number of them in one turn;
- ``llama3`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the whole turn one JSON object
  ``{"name", "parameters"}``, after an optional ``<|python_tag|>``.

A call that does not parse, names no known tool, or whose arguments the tool refuses is not an
exception: it is answered with an error message the model reads on its next turn (and counted),
as it would be by a real tool server.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Dict, List, Mapping, Optional

STYLES = ("hermes", "llama3")
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call an assistant turn asks for: ``name`` and ``arguments``, or, when the text
    could not be read as a call, ``error`` (what was wrong, shown to the model)."""

    name: Optional[str]
    arguments: Dict[str, Any]
    error: Optional[str] = None


def parse_tool_calls(text: str, *, style: str) -> List[ToolCall]:
    """The calls in an assistant turn's ``text`` (none: a plain answer)."""
    if style == "hermes":
        return [_call(body.strip(), arguments_key="arguments")
                for body in _HERMES.findall(text)]
    if style == "llama3":
        body = text.strip()
        body = body[len("<|python_tag|>"):].strip() if body.startswith("<|python_tag|>") else body
        if not body.startswith("{"):
            return []
        return [_call(body, arguments_key="parameters")]
    raise ValueError(f"unknown tool call style {style!r}: one of {STYLES}")


def _call(body: str, *, arguments_key: str) -> ToolCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(None, {}, error=f"the tool call is not JSON ({e.msg} at {e.pos})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall(None, {}, error='a tool call is a JSON object with a "name"')
    arguments = value.get(arguments_key, {})
    if isinstance(arguments, str):  # (Some models write the arguments as a JSON string.)
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(value["name"], {},
                        error=f'"{arguments_key}" of a tool call is a JSON object')
    return ToolCall(value["name"], arguments)


def answer(call: ToolCall, tools: Mapping[str, Callable]) -> Dict[str, Any]:
    """The ``tool`` message answering ``call``: the tool's result (JSON text unless a string),
    or the error the model made, said plainly; ``"error": True`` marks a failed call (for the
    metrics; a chat template reads role and content only)."""
    if call.error is not None:
        return _failed(call, call.error)
    tool = tools.get(call.name)
    if tool is None:
        return _failed(call, f"there is no tool {call.name!r}; the tools are "
                             f"{', '.join(sorted(tools))}")
    try:
        result = tool(**call.arguments)
    except TypeError as e:  # (Missing, extra or wrongly typed arguments.)
        return _failed(call, f"{call.name} cannot take these arguments: {e}")
    except Exception as e:  # pylint: disable=broad-except
        return _failed(call, f"{call.name} failed: {type(e).__name__}: {e}")
    content = result if isinstance(result, str) else json.dumps(result)
    return {"role": "tool", "name": call.name, "content": content}


def _failed(call: ToolCall, message: str) -> Dict[str, Any]:
    return {"role": "tool", "name": call.name or "", "content": f"Error: {message}",
            "error": True}
