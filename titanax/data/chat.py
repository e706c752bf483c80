"""Conversations rendered with a chat template, cut into the spans that are trained and those that
are not.

A chat record (``{"messages": [{"role": ..., "content": ...}, ...]}``) becomes the text the model
would see at inference: the tokenizer's own Jinja ``chat_template`` (its tokenizer_config.json, or
a chat_template.jinja beside it), or ``DEFAULT_TEMPLATE`` ("### <role>" lines) for the byte
tokenizer and the BPEs ``train_tokenizer`` writes. A tokenizer directory that ships no template
(a base model's) is refused for conversations unless ``tokenizer.chat_template`` names one: a
format it invented would be one its tokenizer cannot render at inference. Only what the
assistant says is trained on:

- a template that marks it with ``{% generation %} ... {% endgeneration %}`` (as Hugging Face's
  ``return_assistant_tokens_mask`` expects) trains exactly the marked text;
- any other template is rendered turn by turn: an assistant turn's text is what the conversation
  up to it adds after the *generation prompt* (``add_generation_prompt=True``: the header a model
  is given before it answers), through its end-of-turn marker -- so the model learns to stop.
  That needs each rendering to extend the one before; a template that rewrites earlier turns
  (some drop past reasoning) is refused, naming the record.

Templates run in Jinja's immutable sandbox (a template is code from a model repository).
"""

from __future__ import annotations

import datetime
import os
from typing import List, Optional, Sequence, Tuple

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

# For tokenizers without a template: a "### <role>" line over each message; an assistant turn
# ends with EOS. Each turn starts on a fresh line, so encoding it alone gives the tokens the
# whole text would. (Newlines are written as expressions: trim_blocks drops one after a tag.)
DEFAULT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '### ' + message['role'] + '\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant\\n' }}{% endif %}")
# The name that asks for DEFAULT_TEMPLATE in ``tokenizer.chat_template`` (for a tokenizer that
# ships none: a base model's). ``train_tokenizer`` writes it into the BPEs it trains.
PLAIN = "plain"


def named_template(value: Optional[str]) -> Optional[str]:
    """``value`` with the name PLAIN read as DEFAULT_TEMPLATE."""
    return DEFAULT_TEMPLATE if value == PLAIN else value

# Private-use characters around a {% generation %} block's text while rendering.
_START, _END = "\ue000", "\ue001"


class _GenerationMarks(Extension):
    """``{% generation %}...{% endgeneration %}``: the block's text between two marks."""

    tags = {"generation"}

    def parse(self, parser):
        line = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(line)

    @staticmethod
    def _mark(caller) -> str:
        return _START + caller() + _END


class TemplateError(ValueError):
    """A conversation the template cannot render into trained / untrained spans."""


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = ""):
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=[_GenerationMarks])
        environment.globals["raise_exception"] = _raise
        environment.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self.template = environment.from_string(source)
        self.marks_generation = "generation" in source and "endgeneration" in source
        self.special = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages: Sequence[Tuple[str, str]], *,
               add_generation_prompt: bool = False,
               tools: Optional[Sequence[dict]] = None) -> str:
        """The text transformers' ``apply_chat_template(..., tokenize=False)`` renders (a
        ``{% generation %}`` block is its plain text); ``tools``: the tools' JSON schemas the
        template lists (``agents/tool_schema.py``; None: no tools)."""
        text = self._render_marked(messages, add_generation_prompt=add_generation_prompt,
                                   tools=tools)
        if not self.marks_generation:
            return text
        _check_unmarked(messages)
        return text.replace(_START, "").replace(_END, "")

    def _render_marked(self, messages: Sequence[Tuple[str, str]], *,
                       add_generation_prompt: bool = False,
                       tools: Optional[Sequence[dict]] = None) -> str:
        """The rendering with each ``{% generation %}`` block's text between ``_START`` and
        ``_END``."""
        try:
            return self.template.render(
                messages=[{"role": role, "content": content} for role, content in messages],
                add_generation_prompt=add_generation_prompt,
                **({"tools": list(tools)} if tools else {}), **self.special)
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template refused the conversation: {e}") from e

    def spans(self, messages: Sequence[Tuple[str, str]]) -> List[Tuple[str, bool]]:
        """The conversation's text as ``(text, trained)`` pieces, in order."""
        _check_unmarked(messages)
        if self.marks_generation:
            return _marked_spans(self._render_marked(messages))
        return self._turn_spans(messages)

    def _turn_spans(self, messages: Sequence[Tuple[str, str]]) -> List[Tuple[str, bool]]:
        """Spans from renderings of the conversation up to each assistant turn: what follows
        the generation prompt is the turn (trained); everything else is not."""
        pieces: List[Tuple[str, bool]] = []
        done = ""
        for index, (role, _) in enumerate(messages):
            if role != "assistant":
                continue
            prompt = self._extending(done, self.render(messages[:index],
                                                       add_generation_prompt=True), index)
            answer = self._extending(prompt, self.render(messages[:index + 1]), index)
            pieces += [(prompt[len(done):], False), (answer[len(prompt):], True)]
            done = answer
        whole = self._extending(done, self.render(messages), len(messages))
        pieces.append((whole[len(done):], False))
        return [(text, trained) for text, trained in pieces if text]

    @staticmethod
    def _extending(before: str, after: str, index: int) -> str:
        if not after.startswith(before):
            raise TemplateError(
                f"the chat template renders the conversation up to message {index} as something "
                "other than a continuation of the turns before it, so the assistant's tokens "
                "cannot be told apart (mark them with {% generation %} in the template)")
        return after


def _check_unmarked(messages: Sequence[Tuple[str, str]]) -> None:
    """The marks of {% generation %} blocks cannot be told from a message holding them."""
    if any(_START in c or _END in c for _, c in messages):
        raise TemplateError("a message holds the private-use characters U+E000 / U+E001")


def _marked_spans(text: str) -> List[Tuple[str, bool]]:
    pieces: List[Tuple[str, bool]] = []
    rest = text
    while rest:
        start = rest.find(_START)
        if start < 0:
            pieces.append((rest, False))
            break
        end = rest.find(_END, start)
        pieces += [(rest[:start], False), (rest[start + 1:end], True)]
        rest = rest[end + 1:]
    return [(piece, trained) for piece, trained in pieces if piece]


def _raise(message: str):
    raise jinja2.TemplateError(message)


def template_source(config: Optional[dict], directory: Optional[str]) -> Optional[str]:
    """The chat template a tokenizer directory ships: tokenizer_config.json's ``chat_template``
    (a string, or a list of named ones: "default"), else ``chat_template.jinja``; None."""
    value = (config or {}).get("chat_template")
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value
                 if isinstance(entry, dict)}
        value = named.get("default")
    if isinstance(value, str):
        return value
    if directory is not None:
        path = os.path.join(directory, "chat_template.jinja")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
    return None
