"""The agent objective's train batches: each rollout a batch of episodes played to their end
(``episodes.py``), turned into GRPO rows (``rows.py``).

Per rollout: the next prompts of this process (the prompt input's records), each played
``num_generations`` times (a group: its episodes stay in one batch shard), each episode with a
fresh environment. Each round samples every running episode's next turn with the run's static
sampler, on the training mesh with the current params -- one program: this process's episodes
at the width ``max_tokens``, each in its own row (an ended one's turn thrown away), so an
episode's draws do not depend on which others still run, nor on the process it runs on. The
key of round ``r`` of rollout ``n`` is ``fold_in(fold_in(key(seed), n), r)``, so a resumed run
plays what the uninterrupted run played (the position saved is the rollout stream's:
``rl/rollouts.py``). With several processes, rounds go on while an episode runs on any
process (each round's sampler is one program over all of them).

The advantages are the GRPO family's over the whole batch's episode rewards (each the sum of
its turns' rewards). Each step's metrics: ``reward`` (the mean episode reward), ``reward_std``,
``turns/mean`` (assistant turns per episode), ``tokens/mean`` (an episode's tokens, the
environment's included), ``completions/mean_length`` (the model's tokens per episode),
``ended/done|max_turns|tokens`` (the fractions of episodes ended so), ``tool_calls/mean`` and
``tool_calls/failed`` (tool messages per episode, and the fraction answering a call the model
got wrong), ``entropy``, ``frac_reward_zero_std``, ``rollout/kept_fraction``, and the rollout
stream's times.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np

from titanax import errors
from titanax.agents.episodes import ENDED_BY, Episode, play
from titanax.agents.rows import episode_rows
from titanax.parallel import batch_shards
from titanax.rl.advantages import group_advantages
from titanax.rl.rollout_record import Rollout
from titanax.rl.rollouts import RolloutStream, _mean, _parts, _std

# The per-episode columns gathered from every process, in this order.
_COLUMNS = ("reward", "turns", "tokens", "trained", *(f"ended/{e}" for e in ENDED_BY),
            "tool_calls", "failed_calls", "entropy_sum")


class EpisodeStream(RolloutStream):
    """Iterator of ``(train rows, host metrics)`` of played episodes (module docstring)."""

    def __init__(self, *, make_environment: Callable[[], Any], tools: Sequence[dict],
                 max_turns: int, max_tokens: int, workers: int, **stream):
        """``make_environment()``: a fresh environment; ``tools``: their schemas, rendered by
        the chat template; ``stream``: the rollout stream's arguments (``rl/rollouts.py``)."""
        super().__init__(**stream)
        self.make_environment, self.tools = make_environment, list(tools)
        self.max_turns, self.max_tokens, self.workers = max_turns, max_tokens, workers
        # The last rollout's episodes (what its shown samples read).
        self.episodes: List[Episode] = []

    def _make(self, prompts: Dict[str, np.ndarray], number: int, *, params: Any) -> Rollout:
        cfg = self.objective.config
        started = time.perf_counter()
        source = self.source
        records = [{"prompt": source.prompt_of(int(i)), **source.fields_of(int(i))}
                   for i in prompts["record_index"]]
        key = jax.random.fold_in(self.key, number)
        rounds = itertools.count()

        def sample_turns(prompts: List[List[int]], budgets: List[int]):
            round_key = jax.random.fold_in(key, next(rounds))
            return self._turns(params, prompts, budgets, key=round_key)

        episodes = play(records=records, make_environment=self.make_environment,
                        tokenizer=source.tokenizer, samples=cfg.num_generations,
                        sample_turns=sample_turns, max_turns=self.max_turns,
                        max_tokens=self.max_tokens, tools=self.tools or None,
                        workers=self.workers, keep_going=any_running_across,
                        names=[source.records[int(i)].where for i in prompts["record_index"]])
        self.episodes = episodes
        rollout_s = time.perf_counter() - started
        columns = np.asarray([_columns(e) for e in episodes], np.float64)
        merged, mine = batch_shards.global_rows(columns, self.shards)
        result = group_advantages(merged[:, 0], num_generations=cfg.num_generations,
                                  scale_rewards=self.objective.scale_rewards)
        keep = (~result.equal_group if self.objective.drop_equal_groups
                else np.ones(len(merged), bool))
        metrics = _episode_metrics(merged, keep=keep, equal=result.equal_group,
                                   rollout_s=rollout_s)
        batch = episode_rows([e.trajectory.arrays() for e in episodes], length=self.max_tokens,
                             advantages=result.advantages[mine],
                             row_weights=keep[mine].astype(np.float32))
        parts = _parts(batch, shards=len(self.shards), count=cfg.updates_per_rollout)
        metrics["time/rollout_s"] = rollout_s / (cfg.updates_per_rollout * self.iterations)
        trained = float(np.sum(merged[:, _COLUMNS.index("trained")] * keep)) / len(parts)
        rewards = np.asarray([[e.reward] for e in episodes])
        return Rollout(updates=[(part, metrics, trained) for _ in range(self.iterations)
                                for part in parts],
                       prompt_ids=np.zeros((len(episodes), 0), np.int32),
                       lengths=np.zeros((len(episodes),), np.int32),
                       completion_ids=[[] for _ in episodes], texts=[], per_reward=rewards)

    def _turns(self, params: Any, prompts: List[List[int]], budgets: List[int], *,
               key) -> List[Optional[Tuple[List[int], List[float], float]]]:
        """Each prompt's next turn (at most its budget, through its first end token) and its
        tokens' entropy summed, by one call of the sampler over this process's episodes, each
        in its own row (an ended episode's too -- budget 0 --, its turn thrown away)."""
        width = self.max_tokens
        prompt_ids = np.zeros((len(prompts), width), np.int32)
        lengths = np.asarray([len(p) for p in prompts], np.int32)
        for row, ids in enumerate(prompts):
            prompt_ids[row, width - len(ids):] = ids
        placed = self.place({"prompt_ids": prompt_ids, "prompt_lengths": lengths})
        out = self.sample(params, placed["prompt_ids"], placed["prompt_lengths"], key)
        tokens, logps, entropies = (batch_shards.process_rows(out[name]) for name in
                                    ("tokens", "logps", "entropy"))
        ends = set(self.end_ids)
        turns: List[Optional[Tuple[List[int], List[float], float]]] = []
        for row, budget in enumerate(budgets):
            if budget == 0:
                turns.append(None)
                continue
            sampled = tokens[row].tolist()
            stop = next((i + 1 for i, t in enumerate(sampled) if t in ends), len(sampled))
            stop = min(stop, budget)
            turns.append((sampled[:stop], logps[row, :stop].astype(np.float64).tolist(),
                          float(np.sum(entropies[row, :stop], dtype=np.float64))))
        return turns

    def _show_samples(self, rollout: Rollout, *, first: int) -> None:
        """The first episodes' openings (as the model read them), the rest of their
        conversations (the model's turns and the environment's answers) and rewards."""
        shown = self.episodes[:self.samples.count]
        tokenizer = self.source.tokenizer
        openings, rests = [], []
        for episode in shown:
            ids, trained, _ = episode.trajectory.arrays()
            start = int(np.argmax(trained)) if trained.any() else len(ids)
            openings.append(tokenizer.decode(ids[:start].tolist()))
            rests.append(tokenizer.decode(ids[start:].tolist()))
        self.samples.show(step=first, prompts=openings, completions=rests,
                          rewards=[e.reward for e in shown])


def _columns(episode: Episode) -> List[float]:
    """``_COLUMNS`` of one episode."""
    ids, trained, _ = episode.trajectory.arrays()
    ended = [float(episode.ended_by == e) for e in ENDED_BY]
    return [episode.reward, episode.trajectory.turns, len(ids), float(trained.sum()), *ended,
            episode.tool_calls, episode.failed_calls, episode.entropy]


def any_running_across(running_here: bool, failed_here: bool) -> bool:
    """Whether an episode runs on any process; every process asks together each round. Where
    one has failed (its environment raised, say), the others stop too, naming it (it raises
    its own error)."""
    if jax.process_count() == 1:
        return running_here and not failed_here
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    flags = np.asarray(multihost_utils.process_allgather(
        np.asarray([int(running_here), int(failed_here)], np.int32))).reshape(-1, 2)
    failed = [int(p) for p in np.flatnonzero(flags[:, 1])]
    if failed and not failed_here:
        raise errors.AgentError(
            f"process {failed[0]} stopped: its episodes met an error (its log names the "
            f"environment and the record); every process stops with it",
            suggestion=f"read process {failed[0]}'s error")
    return bool(flags[:, 0].any()) and not failed


def _episode_metrics(merged: np.ndarray, *, keep: np.ndarray, equal: np.ndarray,
                     rollout_s: float) -> Dict[str, float]:
    """The host metrics of the whole batch's episode columns (``_COLUMNS``)."""
    column = {name: merged[:, i] for i, name in enumerate(_COLUMNS)}
    trained = column["trained"]
    calls = float(column["tool_calls"].sum())
    out = {"reward": _mean(column["reward"]), "reward_std": _std(column["reward"]),
           "turns/mean": float(column["turns"].mean()),
           "tokens/mean": float(column["tokens"].mean()),
           "completions/mean_length": float(trained.mean()),
           "tool_calls/mean": float(column["tool_calls"].mean()),
           "tool_calls/failed": float(column["failed_calls"].sum()) / calls if calls else 0.0,
           "entropy": float(column["entropy_sum"].sum() / max(trained.sum(), 1.0)),
           "frac_reward_zero_std": float(np.mean(equal)),
           "rollout/kept_fraction": float(np.mean(keep)),
           "rollout/tokens_per_s": float(trained.sum()) / max(rollout_s, 1e-9)}
    for ended in ENDED_BY:
        out[f"ended/{ended}"] = float(column[f"ended/{ended}"].mean())
    return out
