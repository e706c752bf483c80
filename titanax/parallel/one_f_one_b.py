"""1F1B: forwards and backwards interleaved per stage, from a static schedule table.

GPipe runs every forward before any backward, so each stage keeps the activations of all M
microbatches. 1F1B starts a microbatch's backward as soon as the last stage has its loss, and a
stage never has more than ``S - s`` microbatches in flight (forward done, backward not): the
activations kept are at most S microbatches' stage inputs, whatever M is.

The schedule is a static table (numpy, built on the host) of what every stage does at every tick:
idle, the forward of microbatch m, or its backward. It is simulated greedily under the schedule's
rules -- a forward needs the previous stage's output from an earlier tick, a backward the next
stage's gradient from an earlier tick, a stage does one thing per tick and prefers a backward --
which gives the classic warm-up / steady 1F1B / cool-down shape. At run time a ``lax.scan`` over
the ticks indexes the table with the device's stage and runs the matching branch through
``lax.switch``; every device then issues the same two ``ppermute``s (activations forward,
gradients backward; zeros when idle), so the collectives line up whatever each stage did.

Backward is explicit: a stage's backward recomputes its forward from the saved input under
``jax.vjp`` (stage-level rematerialisation, the price of the flat memory).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, List, Tuple

import numpy as np

IDLE, FORWARD, BACKWARD = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The static 1F1B table of ``num_stages`` stages and ``num_microbatches`` microbatches."""

    num_stages: int
    num_microbatches: int
    # [ticks, stages]: IDLE / FORWARD / BACKWARD.
    kind: np.ndarray
    # [ticks, stages]: the microbatch of that action (0 when idle).
    microbatch: np.ndarray
    # [ticks, stages]: the microbatch whose activation arrives from the previous stage after
    # this tick (-1: none), and whose gradient arrives from the next stage (-1: none).
    forward_arrival: np.ndarray
    backward_arrival: np.ndarray

    @property
    def num_ticks(self) -> int:
        return self.kind.shape[0]

    def max_in_flight(self) -> List[int]:
        """Per stage, the most microbatches ever between their forward and backward."""
        peaks = []
        for stage in range(self.num_stages):
            live = peak = 0
            for tick in range(self.num_ticks):
                live += {FORWARD: 1, BACKWARD: -1, IDLE: 0}[int(self.kind[tick, stage])]
                peak = max(peak, live)
            peaks.append(peak)
        return peaks

    def bubble(self) -> float:
        """Idle fraction of all stage-ticks, forward and backward ticks counted alike. (A
        backward costs about twice a forward, and 1F1B's ticks run in lockstep, so the time
        lost is somewhat more than this.)"""
        return float(np.mean(self.kind == IDLE))


@functools.lru_cache(maxsize=64)
def build_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """Simulates 1F1B tick by tick (see the module docstring). Cached: the step, explain()
    and every logged step's bubble ask for the same table."""
    stages, count = num_stages, num_microbatches
    next_forward = [0] * stages
    next_backward = [0] * stages
    forward_tick: Dict[Tuple[int, int], int] = {}
    backward_tick: Dict[Tuple[int, int], int] = {}
    rows: List[List[Tuple[int, int]]] = []
    tick = 0
    while min(next_backward) < count:
        row = []
        for stage in range(stages):
            m_back, m_fwd = next_backward[stage], next_forward[stage]
            can_back = (m_back < count and forward_tick.get((stage, m_back), tick) < tick
                        and (stage == stages - 1
                             or backward_tick.get((stage + 1, m_back), tick) < tick))
            in_flight = next_forward[stage] - next_backward[stage]
            can_forward = (m_fwd < count and in_flight < stages - stage
                           and (stage == 0 or forward_tick.get((stage - 1, m_fwd), tick) < tick))
            row.append((BACKWARD, m_back) if can_back else (FORWARD, m_fwd) if can_forward
                       else (IDLE, 0))
        for stage, (kind, microbatch) in enumerate(row):
            if kind == FORWARD:
                forward_tick[(stage, microbatch)] = tick
                next_forward[stage] += 1
            elif kind == BACKWARD:
                backward_tick[(stage, microbatch)] = tick
                next_backward[stage] += 1
        rows.append(row)
        tick += 1
        if tick > 4 * (count + stages) + 8:  # pragma: no cover - a bug in the rules above.
            raise RuntimeError("the 1F1B simulation does not terminate")
    kind = np.array([[k for k, _ in row] for row in rows], np.int32)
    microbatch = np.array([[m for _, m in row] for row in rows], np.int32)
    forward_arrival = np.full_like(kind, -1)
    backward_arrival = np.full_like(kind, -1)
    for t in range(kind.shape[0]):
        for stage in range(stages):
            if stage > 0 and kind[t, stage - 1] == FORWARD:
                forward_arrival[t, stage] = microbatch[t, stage - 1]
            if stage < stages - 1 and kind[t, stage + 1] == BACKWARD:
                backward_arrival[t, stage] = microbatch[t, stage + 1]
    return Schedule(num_stages=stages, num_microbatches=count, kind=kind,
                    microbatch=microbatch, forward_arrival=forward_arrival,
                    backward_arrival=backward_arrival)

