"""Episodes of multi-turn RL played to their end: the model's turns sampled together, the
environments' answers computed on the host, several at once.

Why turn by turn over all episodes: each round samples every unfinished episode's next turn in
one call (the decode engine batches them, and an episode that has ended takes no slot), then
every environment answers on a pool of threads -- an environment that waits on a tool or a
process does not hold the others up. An episode ends when its environment says ``done``, after
``max_turns`` turns, or when its tokens run out (a turn that ends without the end token, or no
room left under ``max_tokens``); each episode records which (``ended_by``).

A user's environment that raises, or answers outside the protocol, and a chat template that
cannot grow the conversation, are reported naming the environment's class, the record (its file
and line) and the sample -- never a traceback from inside the pool, and never a hang: with
several processes, the error waits for the next round's agreement (``keep_going``), where every
process learns that one has failed and stops with it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence

from titanax import errors
from titanax.agents import environment as environment_lib
from titanax.agents.trajectory import Trajectory
from titanax.data import chat

# ``(prompts, budgets) -> turns``: one entry per episode of the batch, in order -- its ids
# so far, and its budget of tokens for its next turn (0: it has ended, no turn is wanted);
# each turn ``(ids, logps)`` or ``(ids, logps, entropy)`` (the sampled distributions' entropy
# summed over the turn), ending with the chat template's end token when it ended, None where
# the budget was 0. (Every episode keeps its place: a sampler that draws by place draws the
# same for it however many run beside it.)
SampleTurns = Callable[[List[List[int]], List[int]], List[Optional[tuple]]]
ENDED_BY = ("done", "max_turns", "tokens")


@dataclasses.dataclass
class Episode:
    """One sample's episode for one record."""

    # The record it plays, as errors name it (its file and line, or its place in the batch).
    record: str
    # Which of the record's samples it is.
    sample: int
    # Its own environment (a fresh instance).
    environment: Any
    # Its ids, trained mask and sampler log-probs, grown as it is played.
    trajectory: Optional[Trajectory]
    # This episode's reward per answered turn.
    rewards: List[float] = dataclasses.field(default_factory=list)
    # Why it ended: one of ENDED_BY (empty while it runs).
    ended_by: str = ""
    # The tool messages its environment answered with, and those marked failed
    # (``tool_calls.answer``'s ``"error"``: a call the model got wrong).
    tool_calls: int = 0
    failed_calls: int = 0
    # The entropy of its turns' sampled distributions, summed over their tokens (where the
    # sampler reports it).
    entropy: float = 0.0

    @property
    def reward(self) -> float:
        """The trajectory's reward: the sum of its turns'."""
        return float(sum(self.rewards))

    def said_by(self, method: str) -> str:
        return (f"{type(self.environment).__name__}.{method} (record {self.record}, sample "
                f"{self.sample})")


def play(*, records: Sequence[Dict[str, Any]], make_environment: Callable[[], Any],
         tokenizer: Any, samples: int, sample_turns: SampleTurns, max_turns: int,
         max_tokens: int, tools: Optional[Sequence[dict]] = None, workers: int = 8,
         names: Optional[Sequence[str]] = None,
         keep_going: Optional[Callable[[bool, bool], bool]] = None) -> List[Episode]:
    """Every record's ``samples`` episodes, each with a fresh environment from
    ``make_environment()``, played to their end; in record order, each record's samples
    together. ``names``: the records' names in errors (default: their places). ``keep_going(any
    running here, failed here)``: whether another round is sampled -- with several processes,
    while an episode runs on any; it raises where any process failed (default: while one runs
    here)."""
    names = list(names) if names is not None else [str(i) for i in range(len(records))]
    keep_going = keep_going or (lambda running, failed: running)
    failure: Optional[errors.TitanaxError] = None
    episodes: List[Episode] = []
    try:
        episodes = [_opened(record, name=name, sample=sample, make_environment=make_environment,
                            tokenizer=tokenizer, tools=tools, max_tokens=max_tokens)
                    for record, name in zip(records, names) for sample in range(samples)]
    except errors.TitanaxError as e:
        failure = e
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for turn in range(max_turns):
            running = [e for e in episodes if not e.ended_by]
            if not keep_going(bool(running), failure is not None) or failure is not None:
                break
            _sample_round(episodes, sample_turns=sample_turns, max_tokens=max_tokens)
            answering = [e for e in running if not e.ended_by]
            try:
                for episode, result in zip(answering, pool.map(_step, answering)):
                    _take_answer(episode, result, max_tokens=max_tokens,
                                 last=turn == max_turns - 1)
            except errors.TitanaxError as e:
                failure = e
        else:
            keep_going(False, failure is not None)  # (The last agreement: did any fail?)
    if failure is not None:
        raise failure
    for episode in episodes:
        episode.ended_by = episode.ended_by or "max_turns"
    return episodes


def _opened(record: Dict[str, Any], *, name: str, sample: int, make_environment: Callable,
            tokenizer: Any, tools: Optional[Sequence[dict]], max_tokens: int) -> Episode:
    """Record ``name``'s episode ``sample``: its environment made and reset, the opening
    rendered (refused naming the record when it leaves no room for a turn)."""
    episode = Episode(record=name, sample=sample, environment=make_environment(),
                      trajectory=None)
    opening = _called(episode, "reset", lambda: episode.environment.reset(dict(record)))
    opening = environment_lib.checked_messages(opening, said_by=episode.said_by("reset"),
                                               roles=("system", "user"))
    episode.trajectory = _grown(episode, lambda: Trajectory(
        tokenizer=tokenizer, tools=tools, opening=[(m["role"], m["content"]) for m in opening]))
    if len(episode.trajectory.ids) >= max_tokens:
        raise errors.AgentError(
            f"{episode.said_by('reset')} opens with {len(episode.trajectory.ids)} tokens (the "
            f"chat template's rendering), and an episode holds at most {max_tokens}: no room "
            f"is left for the model's turn", path="objective.max_tokens",
            suggestion=f"raise it above {len(episode.trajectory.ids)}, or open shorter")
    return episode


def _sample_round(episodes: List[Episode], *, sample_turns: SampleTurns,
                  max_tokens: int) -> None:
    """Every running episode's next turn, appended; one out of room or that ran out of tokens
    mid-turn ends by ``tokens``."""
    for episode in episodes:
        if not episode.ended_by and len(episode.trajectory.ids) >= max_tokens:
            episode.ended_by = "tokens"
    turns = sample_turns([list(e.trajectory.ids) for e in episodes],
                         [0 if e.ended_by else max_tokens - len(e.trajectory.ids)
                          for e in episodes])
    for episode, turn in zip(episodes, turns):
        if episode.ended_by:
            continue
        ids, logps = turn[:2]
        episode.entropy += float(turn[2]) if len(turn) > 2 else 0.0
        episode.trajectory.add_turn(ids, logps)
        if not ids or ids[-1] != episode.trajectory.end_id:
            episode.ended_by = "tokens"


def _step(episode: Episode):
    """The environment's checked answer to the episode's conversation."""
    messages = [{"role": role, "content": content}
                for role, content in episode.trajectory.messages]
    messages.append({"role": "assistant", "content": episode.trajectory.last_turn})
    result = _called(episode, "step", lambda: episode.environment.step(messages))
    return environment_lib.checked_step(result, said_by=episode.said_by("step"))


def _take_answer(episode: Episode, result, *, max_tokens: int, last: bool) -> None:
    """The environment's ``result`` for the episode's last turn: its reward kept, its calls
    counted, its messages appended -- unless it is done, the turn was its last
    (``max_turns``), or they would fill its tokens."""
    messages, reward, done = result
    episode.rewards.append(reward)
    calls = [m for m in messages if m["role"] == "tool"]
    episode.tool_calls += len(calls)
    episode.failed_calls += sum(1 for m in calls if m.get("error"))
    if done:
        episode.ended_by = "done"
    elif last:
        episode.ended_by = "max_turns"
    elif not _grown(episode, lambda: episode.trajectory.add_answer(
            [(m["role"], m["content"]) for m in messages], limit=max_tokens)):
        episode.ended_by = "tokens"


def _grown(episode: Episode, grow: Callable[[], Any]) -> Any:
    """``grow()`` (the episode's trajectory growing); a chat template that cannot grow it
    refused naming the episode."""
    try:
        return grow()
    except chat.TemplateError as e:
        raise errors.AgentError(f"rendering the conversation of {episode.said_by('step')}: {e}",
                                path="train_input.tokenizer",
                                suggestion="use a chat template that renders a conversation "
                                           "as the continuation of its beginning") from None


def _called(episode: Episode, method: str, call: Callable[[], Any]) -> Any:
    """``call()``; what it raises reported naming the environment, record and sample."""
    try:
        return call()
    except errors.TitanaxError:
        raise
    except Exception as e:  # pylint: disable=broad-except  (A user's code: anything.)
        raise errors.AgentError(f"{episode.said_by(method)} raised {type(e).__name__}: {e}",
                                suggestion="fix the environment (run it alone on this record "
                                           "to see the traceback)") from e


def engine_turns(engine: Any, *, temperature: float, max_new_tokens: int,
                 stop_ids: Sequence[int]) -> SampleTurns:
    """``SampleTurns`` by the decode engine (``decoding/engine.py``): each prompt one request,
    its turn at most ``max_new_tokens`` (and its budget), ending at a stop id."""
    from titanax.decoding.engine import Request  # pylint: disable=import-outside-toplevel

    def sample(prompts: List[List[int]], budgets: List[int]):
        asked = [i for i, budget in enumerate(budgets) if budget > 0]
        requests = [Request(prompt_ids=tuple(prompts[i]),
                            max_new_tokens=min(max_new_tokens, budgets[i]),
                            temperature=temperature, stop_ids=tuple(stop_ids)) for i in asked]
        turns: List[Optional[tuple]] = [None] * len(prompts)
        for i, group in zip(asked, engine.generate(requests) if requests else []):
            turns[i] = (group[0].tokens, group[0].logps)
        return turns
    return sample
