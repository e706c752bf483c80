"""One episode of multi-turn RL as the ids it trains on, grown turn by turn.

Why grown, never re-tokenized: the model's turns are the ids it sampled. Encoding their text
again could give other ids (a merge across a boundary, a special token spelled out), and the
log-probs the sampler kept would then belong to tokens that are not the ones trained. So the
ids are appended as the episode goes:

- the opening: the chat template's rendering of the environment's first messages (and the
  tools' schemas), through the generation prompt;
- each assistant turn: the ids sampled, as they are, up to and with the turn's end token --
  trained, with the sampler's log-probs;
- after each turn, what the template writes next: the rest of the turn's rendering after its
  end token (a newline, in ChatML), the environment's answer, the next generation prompt --
  encoded on its own, not trained.

The text the ids decode to is therefore the template's rendering of the whole conversation.
A template that renders a later conversation as something other than a continuation of the
earlier one (some drop past reasoning), or rewrites the assistant's text, cannot be grown this
way and is refused naming the turn.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from titanax.data import chat

Message = Tuple[str, str]


class Trajectory:
    """The ids, trained mask and sampler log-probs of one episode (``ids``, ``trained``,
    ``logps``: one entry per token), and its conversation (``messages``)."""

    def __init__(self, *, tokenizer: Any, opening: Sequence[Message],
                 tools: Optional[Sequence[dict]] = None):
        """``tokenizer``: the run's ``data.tokenizer.Tokenizer``; ``opening``: the episode's
        first messages ``(role, content)``; ``tools``: their JSON schemas, listed by the
        template."""
        self.tokenizer, self.tools = tokenizer, tools
        self.template = tokenizer.chat_template
        self.messages: List[Message] = [tuple(m) for m in opening]
        self._text = self._render(self.messages, generation_prompt=True)
        self.ids: List[int] = tokenizer.encode_markup(self._text, start=True)
        self.trained: List[bool] = [False] * len(self.ids)
        self.logps: List[float] = [0.0] * len(self.ids)
        self.turns = 0
        end_ids = tokenizer.chat_end_ids()
        self.end_id = end_ids[0] if end_ids else None
        self._pending: Optional[str] = None  # (The last turn's text, its answer not yet in.)

    def add_turn(self, ids: Sequence[int], logps: Sequence[float]) -> str:
        """The assistant's sampled ``ids`` (ending with the template's end token when the turn
        ended) and their log-probs, appended and trained; returns the turn's text (its content,
        the end token left out)."""
        if self._pending is not None:
            raise ValueError("a turn follows a turn: add the environment's answer between")
        ids = [int(i) for i in ids]
        if len(logps) != len(ids):
            raise ValueError(f"{len(ids)} sampled ids and {len(logps)} log-probs")
        body = ids[:-1] if ids and ids[-1] == self.end_id else ids
        content = self.tokenizer.decode(body)
        self.ids += ids
        self.trained += [True] * len(ids)
        self.logps += [float(x) for x in logps]
        self.turns += 1
        self._pending = content
        return content

    @property
    def last_turn(self) -> Optional[str]:
        """The last assistant turn's text while its answer is not in yet (else None)."""
        return self._pending

    def add_answer(self, answer: Sequence[Message], *, limit: Optional[int] = None) -> bool:
        """The environment's ``answer`` messages after the last turn: the template's text from
        that turn's end token through the next generation prompt, appended, not trained.
        Returns False, appending nothing (neither ids nor messages), when the ids would then
        reach ``limit`` (no room is left for another turn: the episode ends by its tokens)."""
        if self._pending is None:
            raise ValueError("an answer follows an assistant turn")
        turn = ("assistant", self._pending)
        through = self._extending(self._text, self._render(self.messages + [turn]), "turn")
        written = through[len(self._text):]
        marker = self.tokenizer.token(self.end_id)
        if not (written.startswith(self._pending) and
                written[len(self._pending):].startswith(marker)):
            raise chat.TemplateError(
                f"the chat template writes assistant turn {self.turns} as {written!r}, not as "
                f"the text sampled followed by {marker!r}: the sampled ids would not be the "
                f"conversation's")
        after_end = written[len(self._pending) + len(marker):]
        messages = self.messages + [turn, *[tuple(m) for m in answer]]
        following = self._extending(through, self._render(messages, generation_prompt=True),
                                    "answer")
        new = self.tokenizer.encode_markup(after_end + following[len(through):], start=False)
        self._pending = None
        if limit is not None and len(self.ids) + len(new) >= limit:
            return False
        self.messages = messages
        self.ids += new
        self.trained += [False] * len(new)
        self.logps += [0.0] * len(new)
        self._text = following
        return True

    def arrays(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(ids, trained, logps)`` as arrays."""
        return (np.asarray(self.ids, np.int32), np.asarray(self.trained, bool),
                np.asarray(self.logps, np.float32))

    def _render(self, messages: Sequence[Message], *, generation_prompt: bool = False) -> str:
        return self.template.render(messages, add_generation_prompt=generation_prompt,
                                    tools=self.tools)

    def _extending(self, before: str, after: str, what: str) -> str:
        if not after.startswith(before):
            raise chat.TemplateError(
                f"the chat template renders the conversation after assistant turn "
                f"{self.turns}'s {what} as something other than a continuation of the "
                f"conversation before it, so the sampled ids cannot be kept as they are")
        return after
