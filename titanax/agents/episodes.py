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

# ``(prompts, budgets) -> [(ids, logps)]``: each prompt's next turn, at most its budget of
# tokens, ending with the chat template's end token when it ended.
SampleTurns = Callable[[List[List[int]], List[int]], List[Tuple[List[int], List[float]]]]
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

    @property
    def reward(self) -> float:
        """The trajectory's reward: the sum of its turns'."""
        return float(sum(self.rewards))

    def said_by(self, method: str) -> str:
        return (f"{type(self.environment).__name__}.{method} (record {self.record}, sample "
                f"{self.sample})")


def play(*, records: Sequence[Dict[str, Any]], environment: str, where: str, tokenizer: Any,
         samples: int, sample_turns: SampleTurns, max_turns: int, max_tokens: int,
         tools: Optional[Sequence[dict]] = None, workers: int = 8) -> List[Episode]:
    """Every record's ``samples`` episodes with a fresh instance of the environment class at
    ``environment`` (``where``: its config path), played to their end; in record order, each
    record's samples together."""
    episodes = []
    for index, record in enumerate(records):
        for sample in range(samples):
            env = environment_lib.load_environment(environment, where=where)
            episode = Episode(record=index, sample=sample, environment=env, trajectory=None)
            opening = _called(episode, "reset", lambda e=env, r=record: e.reset(dict(r)))
            opening = environment_lib.checked_messages(opening, said_by=episode.said_by("reset"),
                                                       roles=("system", "user"))
            episode.trajectory = Trajectory(tokenizer=tokenizer, tools=tools, opening=[
                (m["role"], m["content"]) for m in opening])
            episodes.append(episode)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for _ in range(max_turns):
            running = [e for e in episodes if not e.ended_by]
            if not running:
                break
            _sample_round(running, sample_turns, max_tokens)
            answering = [e for e in running if not e.ended_by]
            for episode, result in zip(answering, pool.map(_step, answering)):
                _take_answer(episode, result)
    for episode in episodes:
        episode.ended_by = episode.ended_by or "max_turns"
    return episodes


def _sample_round(running: List[Episode], sample_turns: SampleTurns, max_tokens: int) -> None:
    """Every running episode's next turn, appended; one out of room or that ran out of tokens
    mid-turn ends by ``tokens``."""
    roomy = [e for e in running if len(e.trajectory.ids) < max_tokens]
    for episode in running:
        if episode not in roomy:
            episode.ended_by = "tokens"
    if not roomy:
        return
    turns = sample_turns([list(e.trajectory.ids) for e in roomy],
                         [max_tokens - len(e.trajectory.ids) for e in roomy])
    for episode, (ids, logps) in zip(roomy, turns):
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


def _take_answer(episode: Episode, result) -> None:
    messages, reward, done = result
    episode.rewards.append(reward)
    if done:
        episode.ended_by = "done"
    else:
        episode.trajectory.add_answer([(m["role"], m["content"]) for m in messages])


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
        requests = [Request(prompt_ids=tuple(p), max_new_tokens=min(max_new_tokens, b),
                            temperature=temperature, stop_ids=tuple(stop_ids))
                    for p, b in zip(prompts, budgets)]
        return [(group[0].tokens, group[0].logps) for group in engine.generate(requests)]
    return sample
