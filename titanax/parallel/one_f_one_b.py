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
the ticks indexes the table with the device's stage and runs the matching action (idle,
forward, backward: one branch each, for every stage) through ``lax.switch``; every device then
issues the same two ``ppermute``s (activations forward, gradients backward; zeros when idle), so
the collectives line up whatever each stage did.

Backward is explicit: a stage's backward recomputes its forward from the saved input under
``jax.vjp`` (stage-level rematerialisation, the price of the flat memory). ``one_f_one_b`` runs a
table for a model's stage functions (``StageFunctions``); like ``pipeline.gpipe`` it knows nothing
of the model.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from titanax.parallel import collectives
from titanax.utils.dtypes import wide_float

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



@dataclasses.dataclass(frozen=True)
class StageFunctions:
    """What the 1F1B executor runs, in local view (every function traced by every device)."""

    # (outside params, microbatch index) -> the activation entering stage 0.
    first_input: Callable[[Any, Any], jax.Array]
    # (staged params, x, microbatch index) -> (this device's stage output, its summaries).
    run_stage: Callable[[Any, jax.Array, Any], Tuple[jax.Array, Dict[str, jax.Array]]]
    # (outside params, the last stage's output, microbatch index) -> (objective, (loss, aux,
    # summaries)): the head and the loss; its vjp starts the backward of that microbatch.
    head: Callable[[Any, jax.Array, Any], Tuple[jax.Array, Tuple[Any, Any, Any]]]


@dataclasses.dataclass(frozen=True)
class Result:
    """Gradients and the summed loss, aux and summaries of every microbatch on this device."""

    staged_grads: Any
    outside_grads: Any
    loss: jax.Array
    aux: Any
    summaries: Dict[str, jax.Array]


def one_f_one_b(functions: StageFunctions, staged: Any, outside: Any, *, axis: str,
                num_microbatches: int) -> Result:
    """Forwards and backwards of ``num_microbatches`` microbatches by the 1F1B table over
    ``axis``. Forward summaries come back as partial sums over ``axis`` of the mean over
    microbatches and stages (the head's are ``head``'s own)."""
    return _Ticks(functions, staged, outside, axis=axis, count=num_microbatches).run()


class _Ticks:
    """One ``lax.scan`` over the table's ticks; per tick a ``lax.switch`` on what this stage
    does -- nothing, a forward or a backward -- then the two ring ``ppermute``s every device
    issues.

    Each of the three branches is written once for every stage: where the first or the last
    stage differs (its input is the microbatch's; its backward starts at the head) a small
    ``lax.cond`` on the stage index inside the branch says so. The stage's program therefore
    appears twice in the step (its forward; its recomputed forward and backward), not once per
    kind of stage -- the compiled program, and its compile time, shrink by more than half
    (measured: see ``run``).
    """

    def __init__(self, functions: StageFunctions, staged: Any, outside: Any, *, axis: str,
                 count: int):
        self.f = functions
        self.staged, self.outside = staged, outside
        self.axis, self.count = axis, count
        self.stages = collectives.axis_size(axis)
        if self.stages < 2:  # (One stage would be first and last: its forward never runs.)
            raise ValueError(f"1F1B needs at least 2 stages over {axis!r}, got {self.stages}")
        self.table = build_schedule(self.stages, count)
        self.stage_index = collectives.axis_index(axis)
        self.first = self.stage_index == 0
        self.last = self.stage_index == self.stages - 1
        activation = jax.eval_shape(lambda: functions.first_input(outside, 0))
        everywhere = collectives.manual_axes()
        # Every branch of a tick sends activations typed alike: varying everywhere (a stage of
        # a bias-free TP model returns its residual stream invariant over the model axis).
        self.varying = lambda x: collectives.cast_varying(x, everywhere)  # noqa: E731
        self.zeros_act = self.varying(jnp.zeros(activation.shape, activation.dtype))
        self.activation = activation

    def initial_carry(self) -> Dict[str, Any]:
        _, (loss, aux, head_summaries) = jax.eval_shape(
            lambda: self.f.head(self.outside, self.zeros_act, 0))
        _, stage_summaries = jax.eval_shape(
            lambda: self.f.run_stage(self.staged, self.zeros_act, 0))
        both = set(stage_summaries) & set(head_summaries)
        if both:  # (Two statistics -- over the stages' layers, over the head's -- under a name.)
            raise ValueError(f"summaries {sorted(both)} come from both the stages and the head: "
                             "name them apart")
        buffer = (self.stages,) + self.activation.shape
        def zeros(a, dtype=None):
            return self.varying(jnp.zeros(a.shape, dtype or a.dtype))
        return {
            "acts": self.varying(jnp.zeros(buffer, self.activation.dtype)),
            "grads_in": self.varying(jnp.zeros(buffer, self.activation.dtype)),
            "g_stage": jax.tree_util.tree_map(jnp.zeros_like, self.staged),
            "g_outside": jax.tree_util.tree_map(jnp.zeros_like, self.outside),
            "loss": self.varying(jnp.zeros((), loss.dtype)),
            "aux": jax.tree_util.tree_map(zeros, aux),
            "summaries": {k: zeros(a, wide_float(a.dtype))
                          for k, a in {**stage_summaries, **head_summaries}.items()},
        }

    # --- What a stage does in one tick: (carry, m) -> (carry, sent forward, sent backward) ------

    def idle(self, carry, m):
        """Nothing -- also the last stage's forward: its input is kept (it arrived), and its
        backward runs the stage and the head."""
        del m
        return carry, self.zeros_act, self.zeros_act

    def _with_stage_summaries(self, carry, summaries):
        scale = 1.0 / (self.count * self.stages)
        return dict(carry, summaries={k: v + scale * summaries.get(k, 0.0)
                                      for k, v in carry["summaries"].items()})

    def forward(self, carry, m):
        """The stage on microbatch ``m``'s input: the microbatch's own at the first stage (kept
        for the backward), the previous stage's output elsewhere."""
        slot = m % self.stages
        x = jax.lax.cond(self.first,
                         lambda: self.varying(self.f.first_input(self.outside, m)),
                         lambda: carry["acts"][slot])
        carry = dict(carry, acts=carry["acts"].at[slot].set(x))
        y, summaries = self.f.run_stage(self.staged, x, m)
        return self._with_stage_summaries(carry, summaries), self.varying(y), self.zeros_act

    def _from_head(self, y, m):
        """The last stage: the head's vjp gives the gradient at the stage's output (and the
        outside params'), with the microbatch's loss, aux and summaries."""
        objective, vjp, (loss, aux, summaries) = jax.vjp(
            lambda op, yy: self.f.head(op, yy, m), self.outside, y, has_aux=True)
        d_outside, dy = vjp(jnp.ones_like(objective))
        return self.varying((dy, d_outside, loss, aux, summaries))

    def _from_next_stage(self, carry, slot, y, m):
        """Any other stage: the gradient at its output arrived from the next stage."""
        shapes = jax.eval_shape(lambda: self._from_head(y, m))
        zeros = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes[1:])
        return self.varying((carry["grads_in"][slot], *zeros))

    def backward(self, carry, m):
        """Microbatch ``m``'s backward through this stage: its forward recomputed from the kept
        input under ``jax.vjp`` and run back from the gradient at its output (the head's at the
        last stage). The first stage also runs the input's vjp; the others send the gradient at
        their input back."""
        slot = m % self.stages
        y, vjp, stage_summaries = jax.vjp(
            lambda sp, xx: self.f.run_stage(sp, xx, m), self.staged, carry["acts"][slot],
            has_aux=True)
        dy, d_outside, loss, aux, summaries = jax.lax.cond(
            self.last, lambda: self._from_head(y, m),
            lambda: self._from_next_stage(carry, slot, y, m))
        d_stage, dx = vjp(dy)
        carry = dict(carry, g_stage=_add(carry["g_stage"], d_stage),
                     g_outside=_add(carry["g_outside"], d_outside), loss=carry["loss"] + loss,
                     aux=_add(carry["aux"], aux),
                     summaries={k: v + summaries.get(k, 0.0)
                                for k, v in carry["summaries"].items()})
        # The last stage's forward ran here: its summaries (the others' ran in ``forward``).
        carry = self._with_stage_summaries(carry, {
            k: jnp.where(self.last, v, jnp.zeros_like(v)) for k, v in stage_summaries.items()})
        # (Outside params all frozen -- LoRA: train/trainable.py -- have no gradient.)
        if jax.tree_util.tree_leaves(self.outside):
            def input_grads():
                _, input_vjp = jax.vjp(lambda op: self.f.first_input(op, m), self.outside)
                return self.varying(input_vjp(dx)[0])
            d_input = jax.lax.cond(self.first, input_grads, lambda: self.varying(
                jax.tree_util.tree_map(jnp.zeros_like, self.outside)))
            carry = dict(carry, g_outside=_add(carry["g_outside"], d_input))
        return carry, self.zeros_act, jnp.where(self.first, self.zeros_act, self.varying(dx))

    # --- The loop ------------------------------------------------------------------------------

    def _codes(self) -> np.ndarray:
        """The branch index of every (tick, stage): 0 idle (and the last stage's forward), 1
        forward, 2 backward."""
        table, stages = self.table, np.arange(self.stages)
        forward = (table.kind == FORWARD) & (stages < self.stages - 1)
        return np.where(table.kind == BACKWARD, 2, np.where(forward, 1, 0)).astype(np.int32)

    def run(self) -> Result:
        """The ticks. (Measured, ``--config=qwen3_5_tiny --compile_only`` on 8 CPU devices,
        data 4 x pipe 2: 46.8 s with a branch per action and kind of stage -- the stage's
        program five times over -- 19.6 s with these three.)"""
        branches = [self.idle, self.forward, self.backward]
        codes, microbatches = jnp.asarray(self._codes()), jnp.asarray(self.table.microbatch)
        forward_arrival = jnp.asarray(self.table.forward_arrival)
        backward_arrival = jnp.asarray(self.table.backward_arrival)
        ahead = [(i, i + 1) for i in range(self.stages - 1)]
        behind = [(i + 1, i) for i in range(self.stages - 1)]
        stage = self.stage_index

        def tick(carry, t):
            carry, forward_out, backward_out = jax.lax.switch(
                codes[t, stage], branches, carry, microbatches[t, stage])
            from_before = collectives.ppermute(forward_out, self.axis, ahead)
            from_after = collectives.ppermute(backward_out, self.axis, behind)
            carry = dict(carry,
                         acts=_receive(carry["acts"], from_before, forward_arrival[t, stage]),
                         grads_in=_receive(carry["grads_in"], from_after,
                                           backward_arrival[t, stage]))
            return carry, None

        final, _ = jax.lax.scan(tick, self.initial_carry(), jnp.arange(self.table.num_ticks))
        return Result(staged_grads=final["g_stage"], outside_grads=final["g_outside"],
                      loss=final["loss"], aux=final["aux"], summaries=final["summaries"])


def _add(a: Any, b: Any) -> Any:
    return jax.tree_util.tree_map(jnp.add, a, b)


def _receive(buffer: jax.Array, value: jax.Array, microbatch: jax.Array) -> jax.Array:
    """``buffer`` with ``value`` in the slot of ``microbatch`` (unchanged when it is -1)."""
    stages = buffer.shape[0]
    slot = jnp.maximum(microbatch, 0) % stages
    kept = jax.lax.dynamic_index_in_dim(buffer, slot, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(microbatch >= 0, value, kept),
                                               slot, 0)
