"""Rollouts sampled ahead (asynchronous GRPO): with ``max_staleness`` k, the rollout the next
steps train on was sampled with params up to k rollouts old, so sampling need not wait for the
optimizer -- rollout n+1 is sampled while rollout n's steps train (NeMo-RL's and verl's largest
gain). How the loss treats the stale tokens is GRPO's ``importance_correction``
(``objectives/grpo.py``: by default the clipped ratio to the sampler's log-probs).

Each rollout started ahead is sampled with a copy of the params as they are when it starts (the
train step donates the live ones, and a copy leaves them free to change). On CPU devices it runs
on a worker thread, so it overlaps the steps. Elsewhere it runs on the caller's thread when it
starts: two threads launching programs with collectives over the same accelerators may launch
them in different orders on different devices, and their collectives would then wait on each
other (not yet checked on a GPU). Its key, its prompts and its params are fixed when it starts,
so where and when it runs changes nothing it draws. A checkpoint saves the rollouts started
ahead whole (``rollout_record.py``), waiting for them; GRPO refuses it with several processes
(the checkpoint's data state holds one process's rows).
"""

from __future__ import annotations

import collections
import concurrent.futures
from typing import Any, Callable, Dict, List

import jax
import jax.numpy as jnp

from titanax.rl.rollout_record import Rollout


class RolloutsAhead:
    """The rollouts started ahead, oldest first."""

    def __init__(self, *, max_staleness: int):
        self.max_staleness = max_staleness
        self._started: "collections.deque[concurrent.futures.Future]" = collections.deque()
        self._worker = None

    def __len__(self) -> int:
        return len(self._started)

    def wants_more(self) -> bool:
        return len(self._started) < self.max_staleness

    def start(self, make: Callable[..., Rollout], prompts: Dict[str, Any], number: int, *,
              params: Any) -> None:
        """Starts ``make(prompts, number, params=a copy of params)``."""
        copied = jax.tree_util.tree_map(jnp.copy, params)
        jax.block_until_ready(copied)  # (Read before the next step donates the originals.)
        if jax.default_backend() != "cpu":
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(make(prompts, number, params=copied))
        else:
            if self._worker is None:
                self._worker = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="titanax-rollout")
            future = self._worker.submit(make, prompts, number, params=copied)
        self._started.append(future)

    def oldest(self) -> Rollout:
        """The oldest rollout started, waited for (its error, if any, raised here)."""
        return self._started.popleft().result()

    def to_json(self) -> List[Dict[str, Any]]:
        """Every rollout started, waited for, as a checkpoint keeps it."""
        return [future.result().to_json() for future in self._started]

    def restore(self, saved: List[Dict[str, Any]]) -> None:
        """The rollouts a checkpoint kept, in place of any started."""
        self._started.clear()
        for entry in saved:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(Rollout.from_json(entry))
            self._started.append(future)
