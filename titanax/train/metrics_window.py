"""The metrics of the steps since the last log line: checked, timed and handed to the loggers.

Device metrics are kept as arrays until a log step (reading them would wait for the step), then
read at once: every step's loss is checked for NaN / Inf (the step's own ``loss_finite`` verdict
covers every device, so every process stops alike), and the last step's values are logged with
the window's step time, tokens (or examples) per second, TFLOP/s and MFU from the compiled step's
flop count, the ETA, and what the schedule fixes (a pipeline's bubble).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import jax
import numpy as np

from titanax import errors
from titanax.observe import goodput, memory, throughput

_log = logging.getLogger("titanax")


class MetricsWindow:
    """Collects step metrics between log lines (``add``) and reports them (``flush``)."""

    def __init__(self, *, loggers: Sequence[Any], total: int, nan_policy: str,
                 history: List[Dict[str, float]],
                 compiled: Callable[[], Optional[Any]],
                 schedule_metrics: Callable[[], Dict[str, float]]):
        """``history``: the list every step's values are appended to; ``compiled()``: the
        current CompiledStep (flops, compile time, memory); ``schedule_metrics()``: metrics
        fixed by the schedule for the latest batch."""
        self.loggers, self.total, self.nan_policy = list(loggers), total, nan_policy
        self.history = history
        self._compiled, self._schedule_metrics = compiled, schedule_metrics
        self.pending: List[Dict[str, jax.Array]] = []
        self.started_at = time.perf_counter()
        self.timed_steps = 0  # Steps in the window that ran after the compile.
        self._compile_seen = False

    def add(self, metrics: Dict[str, jax.Array], *, step_index: int) -> None:
        """Step ``step_index``'s device metrics. The first step of a run compiled: it is
        waited for and not timed (its compile time is logged on its own)."""
        if not self._compile_seen:
            jax.block_until_ready(metrics)
            self._compile_seen = True
            self._log_compile(step_index)
            self.started_at, self.timed_steps = time.perf_counter(), 0
        else:
            self.timed_steps += 1
        self.pending.append(metrics)

    def _log_compile(self, step: int) -> None:
        compiled = self._compiled()
        seconds = compiled.compile_seconds[-1] if compiled and compiled.compile_seconds else 0.0
        _log.info("compiled the train step in %.2fs", seconds)
        for logger in self.loggers:
            logger.log_dict({"compile_time_s": seconds}, step)

    def flush(self, step: int) -> None:
        """Reads, checks and logs the pending steps (``step``: the last one's number)."""
        if not self.pending:
            return
        values = [{k: first_value(v) for k, v in m.items()} for m in self.pending]
        # Timed once the values are read: reading waits for the window's last step to finish
        # (timed at dispatch, a log line every step showed ~20x the real speed on CPU).
        elapsed = time.perf_counter() - self.started_at
        self.pending = []
        self._check_finite(values, step - len(values) + 1)
        self.history.extend(values)
        last = dict(values[-1])
        last.update(self._rates(elapsed, step))
        last.update(self._schedule_metrics())
        last["goodput"] = goodput.CLOCK.goodput()
        compiled = self._compiled()
        if compiled is not None and compiled.compile_seconds:
            last["compile_time_s"] = sum(compiled.compile_seconds)
            peak = memory.watermark_bytes(compiled.latest_step_bytes)
            if peak is not None:
                last["peak_memory_gib"] = peak / 2 ** 30
        goodput.CLOCK.trained(step)  # (Recorded before the row: a kill between them redoes.)
        for logger in self.loggers:
            logger.log_dict(last, step)
        self.started_at, self.timed_steps = time.perf_counter(), 0

    def _check_finite(self, values: List[Dict[str, float]], first_step: int) -> None:
        for offset, m in enumerate(values):
            # The step's own verdict covers every device (with sync_metrics=False "loss" is
            # only this process's first shard): every process stops alike.
            finite = m["loss_finite"] > 0 if "loss_finite" in m else math.isfinite(m["loss"])
            if not finite and self.nan_policy == "stop":
                shown = (f"the loss is {m['loss']}" if not math.isfinite(m["loss"])
                         else "the loss is not finite on another data shard")
                raise errors.NonFiniteError(
                    f"{shown} at step {first_step + offset}", path=f"step {first_step + offset}",
                    suggestion="lower the learning rate, enable clipping (learner.max_grad_norm) "
                               "or loss scaling, or set nan_policy='skip'")

    def _rates(self, elapsed: float, step: int) -> Dict[str, float]:
        """Step time and what follows from it (the compile step alone has none)."""
        if not self.timed_steps:
            return {}
        step_time = elapsed / self.timed_steps
        last = self.history[-1]
        out = {"step_time_s": step_time, "eta_s": (self.total - step) * step_time}
        if "aux/num_tokens" in last:
            out["tokens_per_s"] = last["aux/num_tokens"] / step_time
        elif "aux/num_examples" in last:
            out["examples_per_s"] = last["aux/num_examples"] / step_time
        compiled = self._compiled()
        flops = compiled.latest_flops if compiled is not None else None
        if flops is not None:
            out["tflops_per_device"] = flops / step_time / 1e12
            utilisation = throughput.mfu(flops, step_time)
            if utilisation is not None:
                out["mfu"] = utilisation
        return out


def first_value(value: Any) -> float:
    """A metric as a Python float: its value, or -- per data shard (``sync_metrics=False``) --
    the first shard this process holds (another process's shards are not addressable here)."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        first = min(value.addressable_shards,
                    key=lambda shard: tuple(s.start or 0 for s in shard.index))
        value = first.data
    return float(np.asarray(jax.device_get(value)).reshape(-1)[0])
