"""The training loop: batches in, steps dispatched, metrics, evaluations, checkpoints, signals.

Per step, in order: the hooks' ``before_step``, the next host batch (prepared while the previous
step still runs), ``on_batch``, at most ``max_inflight_steps`` steps executing at once, the step
itself (inside a profiler window when one is configured), its metrics into the window (flushed
every ``log_every`` steps), ``after_step``, the evalers that are due, a checkpoint when the policy
says so (else a local-tier save when that is due) -- or when a SIGTERM / Ctrl-C arrived, after which the loop stops once the save is
verified on disk. The process's goodput clock (observe/goodput.py) is told what each moment is
spent on: the step (productive, or redone when an earlier launch trained it), the data, an
evaluation, a checkpoint. An iterator whose position cannot be saved at every step (``at_boundary()``
False: a sampling objective's rollout between its updates) defers both to the next step it can. The loop knows
nothing of how the step is parallel.
"""

from __future__ import annotations

import dataclasses
import signal
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import jax

from titanax.io.checkpointer import OrbaxCheckpoint
from titanax.observe import goodput
from titanax.observe.profiler import Profile
from titanax.train.metrics_window import MetricsWindow


@dataclasses.dataclass
class TrainingLoop:
    """Runs steps from ``start`` to ``total`` (see the module docstring)."""

    # One step on a host batch: updates the train state, returns the device metrics.
    train_step: Callable[[Any], Dict[str, jax.Array]]
    # The train state's step counter.
    current_step: Callable[[], int]
    # Objects with any of before_step(step), on_batch(step, host_batch), after_step(step, m).
    hooks: Sequence[Any]
    window: MetricsWindow
    log_every: int
    # Steps allowed to execute at once (None: unbounded).
    inflight_limit: Optional[int]
    # Runs the evalers due at a step: run_evals(step, only_due).
    evals_due: Callable[[int], bool]
    run_evals: Callable[[int, bool], Any]
    checkpointer: Optional[OrbaxCheckpoint] = None
    # Starts a save of the current state and the data iterator's position.
    save: Callable[[Any], Any] = lambda iterator: None
    # The same to the checkpointer's local tier.
    save_local: Callable[[Any], Any] = lambda iterator: None
    # SIGTERM / SIGINT save a checkpoint before stopping (needs a checkpointer).
    save_on_preemption: bool = True
    profiler: Optional[Profile] = None

    def run(self, iterator: Iterator, *, start: int, total: int, eval_every: Optional[int],
            guard: Any) -> None:
        try:
            self._steps(iterator, start, total, eval_every, guard)
        finally:
            goodput.CLOCK.enter("other")
            if self.profiler is not None:
                self.profiler.stop()

    def _call_hooks(self, method: str, *args) -> None:
        for hook in self.hooks:
            if hasattr(hook, method):
                getattr(hook, method)(*args)

    def _steps(self, iterator, start, total, eval_every, guard) -> None:
        ckpt, profiler = self.checkpointer, self.profiler
        inflight: List[Any] = []
        deferred = False  # A save due at a step the iterator's position could not be saved.
        clock = goodput.CLOCK
        # Making a batch is a wait for data, or (a rollout's sampling) the step's own work.
        waiting = None if getattr(iterator, "batches_are_work", False) else "data"
        if start == 0:  # A new run: the evalers asked for a baseline (at_start) run first.
            self.run_evals(0, True)
        for index in range(start, total):
            clock.enter(clock.step_bucket(index))
            self._call_hooks("before_step", index)
            try:
                # Prepared while the previous step still runs; host metrics: the objective's
                # own of this batch (a rollout's rewards), logged with the step's.
                with clock.spent_on(waiting or clock.bucket):
                    host_batch, host_metrics = next(iterator)
            except StopIteration:
                print(f"titanax: the training data ran out after step {index}", flush=True)
                break
            self._call_hooks("on_batch", index, host_batch)
            while self.inflight_limit is not None and len(inflight) >= self.inflight_limit:
                jax.block_until_ready(inflight.pop(0))
            if profiler is not None:
                profiler.before_step(index + 1, in_flight=inflight)
            metrics = self.train_step(host_batch)
            if host_metrics:
                metrics = dict(metrics, **host_metrics)
            inflight.append(metrics)
            if profiler is not None:
                profiler.after_step(index + 1, metrics)
            self.window.add(metrics, step_index=index)
            done = index + 1
            if done % self.log_every == 0 or done == total:
                self.window.flush(done)
            self._call_hooks("after_step", done, metrics)
            asked = bool(eval_every) and done % eval_every == 0
            if asked or self.evals_due(done):
                jax.block_until_ready(inflight)
                inflight.clear()
                self.run_evals(done, not asked)
            saving = ckpt is not None and self.save_on_preemption
            stop = guard.should_stop(done)  # (Every process asks at every step.)
            due = ckpt is not None and ckpt.should_save(done)
            if not _at_boundary(iterator):
                # Its position cannot be saved here (a rollout half trained on: rl/rollouts.py):
                # the save -- and a signal's stop -- wait for the next step that can.
                deferred = deferred or due or (stop and saving)
                continue
            self._checkpoint(iterator, done, persistent=due or deferred or stop and saving)
            deferred = False
            if stop:
                self._stop_on_signal(guard, done, saved=saving)
        jax.block_until_ready(inflight)
        self.window.flush(self.current_step())
        self._final_save(iterator)

    def _checkpoint(self, iterator, done: int, *, persistent: bool) -> None:
        """The persistent save when ``persistent``, else a local-tier one when it is due."""
        ckpt = self.checkpointer
        if ckpt is None:
            return
        with goodput.spent_on("checkpoint"):
            if persistent:
                self.save(iterator)
            elif ckpt.should_save_local(done):
                self.save_local(iterator)

    def _final_save(self, iterator) -> None:
        ckpt = self.checkpointer
        if ckpt is None:
            return
        with goodput.spent_on("checkpoint"):
            if ckpt.config.save_at_end:
                self.save(iterator)  # A no-op when this step is saved already.
            verified = ckpt.wait_until_finished()  # Raises unless every save is committed.
        if verified and jax.process_index() == 0:
            print(f"titanax: saved and verified step(s) {verified} in {ckpt.directory}",
                  flush=True)

    def _stop_on_signal(self, guard, done: int, *, saved: bool) -> None:
        """After a SIGTERM / SIGINT: exit 0 once this step is verified on disk; without a
        checkpoint to save to, stop anyway (status 128 + signal: the steps since the start or
        the last save are lost, and the scheduler should know)."""
        ckpt = self.checkpointer
        if saved:
            with goodput.spent_on("checkpoint"):
                ckpt.wait_until_finished()  # Raises unless every save in flight is committed.
            print(f"titanax: {guard.signal_name}: saved step {done} to {ckpt.directory}; "
                  "exiting", flush=True)
            raise SystemExit(0)
        why = "no checkpoint is configured" if ckpt is None else "save_on_preemption is off"
        print(f"titanax: {guard.signal_name}: stopped after step {done}; {why}, so nothing was "
              "saved", flush=True)
        raise SystemExit(128 + int(getattr(signal, guard.signal_name.split()[0])))


def _at_boundary(iterator: Any) -> bool:
    """Whether the iterator's position can be saved now (one that says it cannot, between the
    updates of one rollout, defers checkpoints and a signal's stop to the next step that can)."""
    at_boundary = getattr(iterator, "at_boundary", None)
    return at_boundary() if at_boundary is not None else True
