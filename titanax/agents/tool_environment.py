"""The common environment: the model calls tools until it answers, and the answer is scored.

Why a base class and not another protocol: most agent tasks are "tools, then an answer checked
against the record" -- a user names their tools and the record's answer field, and need not
write ``step`` at all. A subclass sets its tools (Python functions, described to the model by
their schemas: ``tool_schema.py``) and, where needed, how calls are read or answers scored;
its constructor still takes no arguments (the protocol of ``environment.py``).

Each turn (``step``): the calls read from the assistant's turn (``tool_calls.py``, in
``tool_call_style``) are answered with ``tool`` messages, reward 0, not done; a turn with no
call is the answer: scored by ``answer`` (the built-in ``AnswerMatch``: the text's last number
against the record's ``answer`` field, 1 or 0), done. A malformed call or one the tool refuses
is answered with the error, for the model to read (and counted in the metrics).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

from titanax.agents import tool_calls as tool_calls_lib
from titanax.rl.rewards import AnswerMatch


class ToolEnvironment:
    """Tools until an answer, the answer scored against the record (module docstring)."""

    # The functions the model may call (each described by its signature and docstring).
    tools: Sequence[Callable] = ()
    # How an assistant turn writes its calls: tool_calls.STYLES ("hermes", "llama3").
    tool_call_style: str = "hermes"
    # The record's field that opens the episode: a text (the user's message) or chat messages
    # (TRL's conversational form), as they are.
    prompt_field: str = "prompt"
    # How the answer is scored against the record (rl/rewards.py's AnswerMatch config; a
    # subclass sets its own -- one object, shared by the classes that inherit it).
    answer: AnswerMatch.Config = AnswerMatch.default_config()

    def __init__(self):
        # The record of the episode being played (``reset``'s).
        self.record: Dict[str, Any] = {}
        self._score = self.answer.instantiate()

    def reset(self, record: Dict[str, Any]) -> List[Dict[str, str]]:
        self.record = record
        prompt = record[self.prompt_field]
        if isinstance(prompt, list):
            return [dict(message) for message in prompt]
        return [{"role": "user", "content": str(prompt)}]

    def step(self, messages: List[Dict[str, str]]) -> Tuple[List[Dict[str, Any]], float, bool]:
        said = messages[-1]["content"]
        calls = self.calls(said)
        if calls:
            table = {tool.__name__: tool for tool in self.tools}
            return [tool_calls_lib.answer(call, table) for call in calls], 0.0, False
        return [], self.score(said), True

    def calls(self, text: str) -> List[tool_calls_lib.ToolCall]:
        """The tool calls of an assistant turn's ``text`` (none: it is the answer)."""
        if not self.tools:
            return []
        return tool_calls_lib.parse_tool_calls(text, style=self.tool_call_style)

    def score(self, text: str) -> float:
        """The answer's reward (``answer`` against the record; 0 where it abstains)."""
        fields = {name: [value] for name, value in self.record.items()}
        value = self._score(prompts=[self.record.get(self.prompt_field)], completions=[text],
                            completion_ids=[[]], **fields)[0]
        return 0.0 if value is None else float(value)
