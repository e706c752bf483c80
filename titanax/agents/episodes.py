"""Episodes of multi-turn RL played to their end: the model's turns sampled together, the
environments' answers computed on the host, several at once.

Why turn by turn over all episodes: each round samples every unfinished episode's next turn in
one call (the decode engine batches them, and an episode that has ended takes no slot), then
every environment answers on a pool of threads -- an environment that waits on a tool or a
process does not hold the others up. An episode ends when its environment says ``done``, after
``max_turns`` turns, or when its tokens run out (a turn that ends without the end token, or no
room left under ``max_tokens``); each episode records which (``ended_by``).

A user's environment that raises, or answers outside the protocol, is reported naming its
class, the record and the sample -- never a hang, never a traceback from inside the pool.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from titanax import errors
from titanax.agents import environment as environment_lib
from titanax.agents.trajectory import Trajectory

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

    record: int
    sample: int
    environment: Any
    trajectory: Trajectory
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
         keep_going: Optional[Callable[[bool], bool]] = None) -> List[Episode]:
    """Every record's ``samples`` episodes, each with a fresh environment from
    ``make_environment()``, played to their end; in record order, each record's samples
    together. ``keep_going(any running here)``: whether another round is sampled (default:
    while one runs here; with several processes, while one runs on any -- each round's sampler
    is one program over every process's rows)."""
    episodes = [_opened(record, index, sample, make_environment, tokenizer, tools, max_tokens)
                for index, record in enumerate(records) for sample in range(samples)]
    keep_going = keep_going or (lambda running: running)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for _ in range(max_turns):
            running = [e for e in episodes if not e.ended_by]
            if not keep_going(bool(running)):
                break
            _sample_round(episodes, sample_turns, max_tokens)
            answering = [e for e in running if not e.ended_by]
            for episode, result in zip(answering, pool.map(_step, answering)):
                _take_answer(episode, result, max_tokens)
    for episode in episodes:
        episode.ended_by = episode.ended_by or "max_turns"
    return episodes


def _opened(record: Dict[str, Any], index: int, sample: int, make_environment, tokenizer,
            tools, max_tokens: int) -> Episode:
    """Record ``index``'s episode ``sample``: its environment made and reset, the opening
    rendered (refused naming the record when it leaves no room for a turn)."""
    episode = Episode(record=index, sample=sample, environment=make_environment(),
                      trajectory=None)
    opening = _called(episode, "reset", lambda: episode.environment.reset(dict(record)))
    opening = environment_lib.checked_messages(opening, said_by=episode.said_by("reset"),
                                               roles=("system", "user"))
    episode.trajectory = Trajectory(tokenizer=tokenizer, tools=tools, opening=[
        (m["role"], m["content"]) for m in opening])
    if len(episode.trajectory.ids) >= max_tokens:
        raise errors.AgentError(
            f"{episode.said_by('reset')} opens with {len(episode.trajectory.ids)} tokens (the "
            f"chat template's rendering), and an episode holds at most {max_tokens}: no room "
            f"is left for the model's turn", path="objective.max_tokens",
            suggestion=f"raise it above {len(episode.trajectory.ids)}, or open shorter")
    return episode


def _sample_round(episodes: List[Episode], sample_turns: SampleTurns, max_tokens: int) -> None:
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


def _take_answer(episode: Episode, result, max_tokens: int) -> None:
    messages, reward, done = result
    episode.rewards.append(reward)
    calls = [m for m in messages if m["role"] == "tool"]
    episode.tool_calls += len(calls)
    episode.failed_calls += sum(1 for m in calls if m.get("error"))
    if done:
        episode.ended_by = "done"
    elif not episode.trajectory.add_answer([(m["role"], m["content"]) for m in messages],
                                           limit=max_tokens):
        episode.ended_by = "tokens"


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
