"""``python -m titanax.generate --chat --interactive``: a multi-turn chat with a model in one
process.

Each line read is a user message; the whole conversation so far -- an optional system prompt,
then the user's and the model's turns -- is rendered by the tokenizer's chat template with the
generation prompt, and the model's answer is sampled until the template's end-of-turn token.
The answer is printed without its special tokens and kept, as text, as the assistant's turn.
Every turn runs one compiled program: the conversation is left-padded to the window the model
has for it (``max_seq_len - max_new_tokens``), so a turn costs no compilation. A conversation
that outgrows the window is said, not cut: ``/reset`` starts a new one (the system prompt kept);
``/exit`` or the end of the input ends the session.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, Tuple

RESET, EXIT = "/reset", "/exit"


class ChatSession:
    """The conversation and the compiled sampler of one interactive chat."""

    def __init__(self, *, engine: Any, tokenizer: Any, end_ids: List[int], system: Optional[str],
                 max_new_tokens: int, temperature: Optional[float], top_p: float, seed: int):
        """``tokenizer``: a Titanax tokenizer with a chat template; ``end_ids``: the ids that
        end an answer (the template's end-of-turn token among them)."""
        import jax  # pylint: disable=import-outside-toplevel
        self.engine, self.tokenizer, self.end_ids = engine, tokenizer, list(end_ids)
        self.system = system
        self.max_new_tokens = max_new_tokens
        self.window = engine.model.config.max_seq_len - max_new_tokens
        self.rows = engine.plan.batch_shards(engine.mesh)  # One copy per batch shard.
        sampler = engine.steps.sampler(max_new_tokens=max_new_tokens, temperature=temperature,
                                       top_p=top_p, end_ids=self.end_ids)
        self._sample = jax.jit(sampler)
        self._key = jax.random.PRNGKey(seed)
        self.turns = 0
        self.messages: List[Tuple[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [("system", self.system)] if self.system else []

    def prompt_ids(self, message: str) -> List[int]:
        return self.tokenizer.encode_chat_prompt(self.messages + [("user", message)])

    def answer(self, message: str) -> Optional[str]:
        """The model's answer to ``message`` after the conversation so far (kept with it), or
        None when the conversation with it would not fit the window (nothing kept)."""
        import jax  # pylint: disable=import-outside-toplevel
        import numpy as np  # pylint: disable=import-outside-toplevel
        prompt = self.prompt_ids(message)
        if len(prompt) > self.window:
            return None
        padded = np.zeros((self.rows, self.window), np.int32)
        padded[:, self.window - len(prompt):] = prompt
        lengths = np.full((self.rows,), len(prompt), np.int32)
        key = jax.random.fold_in(self._key, self.turns)
        out = self._sample(self.engine.state.params, padded, lengths, key)
        tokens = [int(t) for t in np.asarray(jax.device_get(out["tokens"]))[0]]
        for index, token in enumerate(tokens):
            if token in self.end_ids:
                tokens = tokens[:index]
                break
        text = self.tokenizer.decode(tokens)
        self.turns += 1
        self.messages += [("user", message), ("assistant", text)]
        return text


def run(session: ChatSession, *, lines: Iterable[str], write: Callable[[str], None],
        first: Optional[str] = None) -> int:
    """Answers each line of ``lines`` (after ``first``, when given) until ``/exit`` or their end."""
    write(f"chat: one message per line; {RESET} starts over, {EXIT} (or end of input) quits")

    def messages():
        if first is not None:
            yield first
        for line in lines:
            yield line.rstrip("\n")

    for message in messages():
        if message.strip() == EXIT:
            break
        if message.strip() == RESET:
            session.reset()
            write("(a new conversation)")
            continue
        if not message.strip():
            continue
        write(f"user: {message}")
        text = session.answer(message)
        if text is None:
            write(f"(the conversation no longer fits the model's {session.window} tokens "
                  f"(max_seq_len less --max_new_tokens): {RESET} starts a new one)")
            continue
        write(f"assistant: {text}")
    return 0
