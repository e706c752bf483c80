"""The rollout stream: a GRPO run's train batches, each made from completions the model samples
with its params on its own mesh -- the current ones, or with ``max_staleness`` those of up to
that many rollouts before (``rollouts_ahead.py``).

Per rollout: the next batch of prompts (this process's rows of the prompt input), each repeated
``num_generations`` times (a group: its rows stay in one batch shard), sampled by the run's
sampler (the static KV-cache sampler, ``StepBuilder.sampler``, or the decode engine,
``objective.decoding``: the params and mesh the train step uses -- no weights move); on the
host, the completions cut at their first end token and decoded, scored by the
rewards, the scores gathered from every process, the advantages computed over the global batch
(``advantages.py``), this process's rows kept (``rows.py``). The rollout batch then feeds
``updates_per_rollout`` optimizer steps (equal parts of each shard's rows), ``iterations`` times
over, the rollout's own log-probs the old policy of every one.

The rollout key is ``fold_in(key(seed), rollout number)``; the stream's state -- the prompt
input's position and the rollout number, and the rollouts sampled ahead whole -- is saved with
every checkpoint, so a resumed run samples what the uninterrupted run sampled. Checkpoints
(periodic ones and a signal's) wait for the end of a rollout's updates (``at_boundary``: the
training loop defers them), so every saved position is a rollout's end; only a run's last
save, when ``max_steps`` ends it inside a rollout, is not (a run resumed from it starts the next
rollout, and the log says so).

Each step's metrics gain the host's: ``reward`` (the mean reward of its rollout),
``reward_std``, ``rewards/<name>/mean|std``, ``frac_reward_zero_std``, ``entropy`` (of the
sampled tokens' distributions), ``completions/mean_length``, ``completions/clipped_ratio`` (no
end token within the budget), ``rollout/kept_fraction`` (rows left after dropping all-equal
groups), ``time/rollout_s`` (the rollout's time over its steps), ``time/train_s`` (the previous
step's), ``time/rollout_share``, ``rollout/tokens_per_s`` and ``train/tokens_per_s`` (completion
tokens of the whole batch: sampled, and trained on -- the kept rows' -- per second). At the
first step and every ``samples_every`` steps, a few of the rollout's prompts, completions and
rewards are printed and appended to ``samples.jsonl`` (``observe/samples.py``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np

from titanax.data.prompts import Prompts
from titanax.observe.samples import SampleLog
from titanax.parallel import batch_shards
from titanax.rl.advantages import group_advantages
from titanax.rl.rewards import RewardSet
from titanax.rl.rollout_record import Rollout, Update
from titanax.rl.rollouts_ahead import RolloutsAhead
from titanax.rl.rows import completion_mask, rollout_rows

_log = logging.getLogger("titanax")


class RolloutStream:
    """Iterator of ``(train rows, host metrics)`` (see the module docstring)."""

    # Its batches are the run's own computation (sampling), not a wait for data: the training
    # loop counts their time with the step's (observe/goodput.py).
    batches_are_work = True

    def __init__(self, *, prompts: Any, source: Prompts, objective: Any,
                 rewards: Optional[RewardSet],
                 sample: Any, params: Any, place: Any, shards: Sequence[int], seed: int,
                 end_ids: Sequence[int], iterations: int = 1,
                 samples: Optional[SampleLog] = None, step: Optional[Callable[[], int]] = None,
                 max_staleness: int = 0):
        """``prompts``: an iterator of this process's prompt rows (``get_state`` /
        ``set_state``); ``sample(params, prompt_ids, prompt_lengths, key)``: the run's
        sampler; ``params()``: the current params; ``place(host batch)``: global arrays;
        ``shards``: this process's batch shards (their number of rows each is equal);
        ``objective``: the sampling objective (objectives/sampling.py: its config; with
        ``rewards``, GRPO's scale_rewards and drop_equal_groups); ``rewards`` None: the rows are
        not scored (advantages 0: on-policy distillation scores them in its loss);
        ``samples``: shows a few completions (observe/samples.py) at the steps it is due,
        ``step()`` the run's last finished step; ``max_staleness``: rollouts sampled ahead,
        each with the params of when it was started (``rollouts_ahead.py``; 0: on-policy)."""
        self.prompts, self.source, self.objective = prompts, source, objective
        self.samples, self.step = samples, step
        self.rewards = rewards
        self.sample, self.params, self.place = sample, params, place
        self.shards = tuple(shards)
        self.key = jax.random.fold_in(jax.random.PRNGKey(seed), 0x5A3)  # (Its own stream.)
        self.end_ids = list(end_ids)
        self.iterations = iterations
        self.rollouts = 0  # Rollouts sampled so far.
        # The current rollout's updates left: (train rows, host metrics, completion tokens
        # trained on over the whole batch).
        self.queue: List[Update] = []
        # Rollouts sampled ahead of the one trained on (asynchronous GRPO).
        self.ahead = RolloutsAhead(max_staleness=max_staleness)
        self._handed_at: Optional[float] = None
        self._last_train_tokens = 0.0

    # --- The checkpointed position --------------------------------------------------------------

    def get_state(self) -> Dict[str, Any]:
        state = {"prompts": self.prompts.get_state(), "rollouts": self.rollouts,
                 "updates_left": len(self.queue)}
        if self.ahead.max_staleness:  # (Waits for them: they are saved whole.)
            state["ahead"] = self.ahead.to_json()
        return state

    def at_boundary(self) -> bool:
        """Whether the position can be saved: no update of the current rollout is left."""
        return not self.queue

    def set_state(self, state: Dict[str, Any]) -> None:
        self.prompts.set_state(state["prompts"])
        self.rollouts = int(state["rollouts"])
        self.queue = []
        self.ahead.restore(state.get("ahead", []))
        if state.get("updates_left"):
            _log.warning("resumed inside rollout %d: its %d update(s) left are skipped (the "
                         "checkpoint was taken before they ran)", self.rollouts,
                         state["updates_left"])

    # --- Iteration ------------------------------------------------------------------------------

    def __iter__(self):
        return self

    def __next__(self) -> Tuple[Dict[str, np.ndarray], Dict[str, float]]:
        train_s = None
        if self._handed_at is not None:
            jax.block_until_ready(self.params())  # The previous step has finished.
            train_s = time.perf_counter() - self._handed_at
        if not self.queue:
            self.queue = self._take()
        rows, metrics, train_tokens = self.queue.pop(0)
        metrics = dict(metrics)
        if train_s is not None:
            metrics["time/train_s"] = train_s
            metrics["train/tokens_per_s"] = self._last_train_tokens / max(train_s, 1e-9)
            metrics["time/rollout_share"] = metrics["time/rollout_s"] / (
                metrics["time/rollout_s"] + train_s)
        self._last_train_tokens = train_tokens
        self._handed_at = time.perf_counter()
        return rows, metrics

    def _take(self) -> List[Update]:
        """The next rollout's updates: the oldest sampled ahead, else one sampled now with the
        current params; then rollouts sampled ahead up to ``max_staleness``, each with the
        params as they are now (before this rollout's updates), while the steps train."""
        if self.ahead:
            rollout = self.ahead.oldest()
        else:
            rollout = self._make(*self._start(), params=self.params())
        while self.ahead.wants_more():
            try:
                prompts, number = self._start()
            except StopIteration:
                break
            self.ahead.start(self._make, prompts, number, params=self.params())
        shown_at = self._samples_due(len(rollout.updates))
        if shown_at is not None:
            self._show_samples(rollout, first=shown_at)
        return list(rollout.updates)

    def _start(self) -> Tuple[Dict[str, np.ndarray], int]:
        """The next rollout's prompts and number (StopIteration: the prompts ran out)."""
        prompts = next(self.prompts)
        self.rollouts += 1
        return prompts, self.rollouts - 1

    def _make(self, prompts: Dict[str, np.ndarray], number: int, *, params: Any) -> Rollout:
        """Rollout ``number`` of ``prompts``, sampled with ``params``: sampled, scored, its
        advantages over the whole batch, its updates' rows."""
        cfg = self.objective.config
        started = time.perf_counter()
        group = cfg.num_generations
        prompt_ids = np.repeat(prompts["prompt_ids"], group, axis=0)
        lengths = np.repeat(prompts["prompt_lengths"], group, axis=0)
        records = np.repeat(prompts["record_index"], group, axis=0)
        placed = self.place({"prompt_ids": prompt_ids, "prompt_lengths": lengths})
        out = self.sample(params, placed["prompt_ids"], placed["prompt_lengths"],
                          jax.random.fold_in(self.key, number))
        tokens, logps, entropy = (batch_shards.process_rows(out[name]).astype(dtype) for
                                  name, dtype in (("tokens", np.int64), ("logps", np.float64),
                                                  ("entropy", np.float64)))
        rollout_s = time.perf_counter() - started
        mask = completion_mask(tokens, self.end_ids)
        ended = np.isin(tokens, np.asarray(self.end_ids, np.int64)).any(axis=1)
        completion_ids = [row[:int(m.sum())].tolist() for row, m in zip(tokens, mask)]
        steps = cfg.updates_per_rollout * self.iterations  # (The number of parts, below.)
        # Decoded only for what reads the text: the rewards (samples shown decode their own).
        texts = self._texts(completion_ids) if self.rewards is not None else []
        per_reward = (self._score(texts, completion_ids, records) if self.rewards is not None
                      else np.zeros((len(tokens), 0)))
        # Every process's rows, once each, in the global batch's order.
        columns = [per_reward, (entropy * mask).sum(axis=1, keepdims=True),
                   mask.sum(axis=1, keepdims=True), ended[:, None].astype(float)]
        merged, mine = batch_shards.global_rows(np.concatenate(columns, axis=1), self.shards)
        width = per_reward.shape[1]
        advantages, keep, metrics = self._advantages(merged[:, :width], group)
        metrics.update(self._sample_metrics(entropy_sum=merged[:, width],
                                            lengths=merged[:, width + 1],
                                            ended=merged[:, width + 2] > 0, rollout_s=rollout_s,
                                            keep=keep))
        rows = rollout_rows(prompt_ids=prompt_ids, prompt_lengths=lengths, completion_ids=tokens,
                            completion_mask=mask, old_logps=logps,
                            advantages=advantages[mine],
                            row_weights=keep[mine].astype(np.float32))
        parts = _parts(rows, shards=len(self.shards), count=cfg.updates_per_rollout)
        metrics["time/rollout_s"] = rollout_s / steps
        trained = float(np.sum(merged[:, width + 1] * keep)) / len(parts)
        return Rollout(updates=[(part, metrics, trained) for _ in range(self.iterations)
                                for part in parts],
                       prompt_ids=prompt_ids, lengths=lengths, completion_ids=completion_ids,
                       texts=texts, per_reward=per_reward)

    def _texts(self, completion_ids: List[List[int]]) -> List[str]:
        """The completions' text, their end token left out."""
        ends = set(self.end_ids)
        return [self.source.tokenizer.decode([i for i in ids if i not in ends])
                for ids in completion_ids]

    def _samples_due(self, steps: int) -> Optional[int]:
        """The first step of this rollout's ``steps`` when its samples are shown, else None
        (the run's step is read only where samples are ever shown)."""
        if self.samples is None or self.step is None or not self.samples.shows_any:
            return None
        first = self.step() + 1
        return first if self.samples.due(first_step=first, steps=steps) else None

    def _show_samples(self, rollout: Rollout, *, first: int) -> None:
        """The rollout's first rows' prompts (as the model read them: decoded from their
        tokens, cut as they were), completions and total rewards, shown as step ``first``'s."""
        count = self.samples.count
        width = rollout.prompt_ids.shape[1]
        prompts = [self.source.tokenizer.decode(row[width - int(n):].tolist())
                   for row, n in zip(rollout.prompt_ids[:count], rollout.lengths)]
        texts = rollout.texts or self._texts(rollout.completion_ids[:count])
        self.samples.show(step=first, prompts=prompts, completions=texts,
                          rewards=None if self.rewards is None
                          else self.rewards.total(rollout.per_reward))

    def _score(self, texts: List[str], completion_ids: List[List[int]],
               records: np.ndarray) -> np.ndarray:
        """``[rows, rewards]`` of this process's completions."""
        source = self.source
        fields: Dict[str, List[Any]] = {}
        for index in records:
            for name, value in source.fields_of(int(index)).items():
                fields.setdefault(name, [])
        for index in records:
            own = source.fields_of(int(index))
            for name in fields:
                fields[name].append(own.get(name))
        return self.rewards.score(prompts=[source.prompt_of(int(i)) for i in records],
                                  completions=texts, completion_ids=completion_ids,
                                  fields=fields, budget=self.objective.config.max_new_tokens,
                                  records=[source.records[int(i)].where for i in records])

    def _advantages(self, scores: np.ndarray, group: int):
        """``(advantages, rows kept, reward metrics)`` of the whole batch's ``[rows, rewards]``
        scores (no rewards: advantages 0, every row kept)."""
        if self.rewards is None:
            return np.zeros(len(scores)), np.ones(len(scores), bool), {}
        total = self.rewards.total(scores)
        result = group_advantages(total, num_generations=group,
                                  scale_rewards=self.objective.scale_rewards)
        keep = (~result.equal_group if self.objective.drop_equal_groups
                else np.ones(len(total), bool))
        out: Dict[str, float] = {}
        for column, name in enumerate(self.rewards.names):
            out[f"rewards/{name}/mean"] = _mean(scores[:, column])
            out[f"rewards/{name}/std"] = _std(scores[:, column])
        out["reward"] = _mean(total)
        out["reward_std"] = _std(total)
        out["frac_reward_zero_std"] = float(np.mean(result.equal_group))
        return result.advantages, keep, out

    @staticmethod
    def _sample_metrics(*, entropy_sum, lengths, ended, rollout_s, keep) -> Dict[str, float]:
        tokens = float(lengths.sum())
        return {"rollout/kept_fraction": float(np.mean(keep)),
                "completions/mean_length": float(lengths.mean()),
                "completions/clipped_ratio": float(np.mean(~ended)),
                "entropy": float(entropy_sum.sum() / max(tokens, 1.0)),
                "rollout/tokens_per_s": tokens / max(rollout_s, 1e-9)}


def _mean(values: np.ndarray) -> float:
    """The mean of the scored values (NaN: abstained); 0 when none is."""
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else 0.0


def _std(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(np.std(finite, ddof=1)) if finite.size > 1 else 0.0


def _parts(rows: Dict[str, np.ndarray], *, shards: int,
           count: int) -> List[Dict[str, np.ndarray]]:
    """``rows`` (``shards`` equal blocks of rows) cut into ``count`` batches, each holding an
    equal part of every block (so every batch shard keeps its own rows)."""
    if count == 1:
        return [rows]
    out = []
    for part in range(count):
        def take(values, part=part):
            blocks = values.reshape((shards, -1) + values.shape[1:])
            size = blocks.shape[1] // count
            piece = blocks[:, part * size:(part + 1) * size]
            return piece.reshape((-1,) + values.shape[1:])
        out.append({k: take(v) for k, v in rows.items()})
    return out
