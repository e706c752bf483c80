"""The bundled agent task of ``llama_tiny_agent``: three-digit sums, which a tiny model from
scratch cannot add in its head but can answer by calling a calculator and copying its result.

The bundled data (``titanax/data/bundled/calculator``, written by ``python -m
titanax.agents.calculator --out=DIR``): a tokenizer of single characters (digits, ``+``,
``=``) and special tokens -- start, end of turn, one role token each for user, assistant and
tool, and ``<calc>``, the call: 20 tokens -- with a chat template that writes a message as its
role token and its content (the assistant's followed by the end of turn) and, when tools are
offered, opens with ``<calc>`` (the model is told it may call); and 4,096 prompts
``{"prompt": "123+356=", "a": 123, "b": 356, "answer": "479"}``: each sum drawn uniformly from
100 to 999, its first operand uniformly from 0 to the sum -- every answer has three digits, and
each of its places holds every digit about equally often (no digit is a good guess: only the
sum, or the tool, earns).

``Calculator`` (a ``ToolEnvironment``): a turn that is exactly ``<calc>`` calls ``add`` on the
record's operands (the tool's answer, ``479``, comes back as a tool message); any other turn is
the answer, scored by its characters in place: 0.8 x the fraction of the sum's digits it has
right where they belong (over the longer of the two), and 0.2 more when the episode called
the tool before it -- an episode that calls and copies the tool's answer earns 1; calls that
never reach an answer earn nothing. Why not 1-or-0: a model from scratch would have to hit the
call, three digits and the end together by chance before it learned anything; a call that is
answered, and each digit in place, is credit it can find alone. Without the tool the best is
0.8 x the digits a tiny model guesses in place.

``NoCalculator``: the same task with no tool offered (the template does not open with
``<calc>``, and ``<calc>`` is just a wrong answer) -- what the model reaches without the tool.
"""

from __future__ import annotations

import json
import os
from typing import List

import numpy as np
from absl import app, flags
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from titanax.agents.tool_calls import ToolCall
from titanax.agents.tool_environment import ToolEnvironment

CALL = "<calc>"
# The special tokens, then the characters of the text (ids in this order).
SPECIAL = ("<pad>", "<s>", "<end>", "<user>", "<assistant>", "<tool>", CALL, "<unk>")
CHARACTERS = tuple("0123456789") + ("+", "=")
TEMPLATE = ("{{ bos_token }}{% if tools %}<calc>{% endif %}{% for message in messages %}"
            "<{{ message['role'] }}>{{ message['content'] }}"
            "{% if message['role'] == 'assistant' %}<end>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
PROMPTS = 4096


def add(a: int, b: int) -> int:
    """Adds two whole numbers.

    Args:
        a: The first number.
        b: The second number.

    Returns:
        Their sum.
    """
    return a + b


class Calculator(ToolEnvironment):
    """Three-digit sums with a calculator: ``<calc>`` adds the record's operands."""

    tools = (add,)
    # What an answer earns for a call before it (the answer's digits weigh the rest).
    call_reward = 0.2

    def __init__(self):
        super().__init__()
        # Whether the episode has called the tool.
        self.called = False

    def reset(self, record):
        self.called = False
        return super().reset(record)

    def step(self, messages):
        answer, reward, done = super().step(messages)
        self.called = self.called or not done
        return answer, reward + (self.call_reward if done and self.called else 0.0), done

    def calls(self, text: str) -> List[ToolCall]:
        if text.strip() != CALL:
            return []
        return [ToolCall("add", {"a": int(self.record["a"]), "b": int(self.record["b"])})]

    def score(self, text: str) -> float:
        return (1.0 - self.call_reward) * digits_in_place(text, str(self.record["answer"]))


class NoCalculator(Calculator):
    """The same sums with no tool: every turn is the answer."""

    tools = ()

    def calls(self, text: str) -> List[ToolCall]:
        return []


def digits_in_place(text: str, answer: str) -> float:
    """The fraction of ``answer``'s characters ``text`` has at the same places, over the
    longer of the two (1: equal)."""
    text = text.strip()
    longer = max(len(text), len(answer), 1)
    return sum(a == b for a, b in zip(text, answer)) / longer


def write_bundled(out: str, *, seed: int = 0) -> None:
    """The tokenizer (``tokenizer.json``, ``tokenizer_config.json``) and ``prompts.jsonl``."""

    os.makedirs(out, exist_ok=True)
    vocab = {token: index for index, token in enumerate(SPECIAL + CHARACTERS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in SPECIAL])
    tokenizer.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token": "<s>", "eos_token": "<end>", "pad_token": "<pad>",
                   "unk_token": "<unk>", "chat_template": TEMPLATE}, f, indent=2)
    rng = np.random.default_rng(seed)
    sums = rng.integers(100, 1000, size=PROMPTS)
    firsts = [int(rng.integers(0, total + 1)) for total in sums.tolist()]
    with open(os.path.join(out, "prompts.jsonl"), "w", encoding="utf-8") as f:
        for a, b in ((first, total - first) for first, total in zip(firsts, sums.tolist())):
            f.write(json.dumps({"prompt": f"{a}+{b}=", "a": a, "b": b,
                                "answer": str(a + b)}) + "\n")


def main(argv):
    del argv
    write_bundled(flags.FLAGS.out)


if __name__ == "__main__":
    # (Defined here: the module is imported by runs, whose launcher owns the flags.)
    flags.DEFINE_string("out", None, "the directory to write the bundled data to",
                        required=True)
    app.run(main)
