"""Engine: builds a run from its config and trains it.

Two ways in, one engine:

* Config-driven: ``Engine.Config`` with a ``model`` (a BaseLayer config whose ``forward(batch)``
  returns ``(loss, aux)``), a plan and a learner; ``python -m titanax.launch --config=NAME`` calls
  ``run()``. The train step is Titanax's (``titanax.train.step``).
* Imperative (the seed's UX): ``Engine(mesh=..., plan=..., optimizer=optax.adamw(3e-4), ...)`` and
  ``engine.fit(train_step, data=..., steps=...)`` with a hand-written ``@step_fn``.

Either way the whole step is ``jit(shard_map(step, mesh, in_specs, out_specs))`` over every mesh
axis with the state donated: XLA partitions nothing by itself, so the collectives in the compiled
step are exactly the ones written -- ``collectives()`` lists them.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Literal, Optional, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec

from titanax import errors
from titanax.config import Configurable
from titanax.data.pipeline import Input
from titanax.io.checkpointer import OrbaxCheckpoint
from titanax.modules.base_layer import BaseLayer
from titanax.observe import hlo, state_report, memory, throughput
from titanax.observe.profiler import Profile
from titanax.observe.loggers import Basic, Logger
from titanax.parallel import batch_shards, rules, sharding, state_dims
from titanax.parallel import stages as stages_lib
from titanax.parallel.interleaved_stack import InterleavedStack
from titanax.parallel.plan import DP, Plan
from titanax.runtime.mesh import MeshSpec, describe_mesh
from titanax.train import learner as learner_lib
from titanax.train import step as step_lib
from titanax.train.compiled_step import CompiledStep
from titanax.train.state_manager import StateManager
from titanax.train.evaler import Evaler, summarize
from titanax.train.precision import Precision
from titanax.train import pipeline_report, preemption
from titanax.train.preemption import preemption_guard
from titanax.train.train_state import TrainState
from titanax.train.user_step import UserStep

_log = logging.getLogger("titanax")


class Engine(Configurable):
    """A training run: mesh, plan, model or step, learner, precision, data, loggers, evalers."""

    class Config(Configurable.Config):
        # The device mesh.
        mesh: MeshSpec.Config = MeshSpec.default_config().set(axes=("data",))
        # How the mesh axes are used.
        plan: Plan.Config = Plan.default_config().set(data_parallel=DP.default_config())
        # The model (forward(batch) -> (loss, aux)); None for hand-written steps.
        model: Optional[BaseLayer.Config] = None
        # Optimizer, schedule, clipping, weight decay.
        learner: learner_lib.Learner.Config = learner_lib.Learner.default_config()
        # An optax GradientTransformation for hand-written steps (seed UX); overrides learner.
        optimizer: Optional[Any] = None
        # Mixed precision and loss scaling.
        precision: Precision.Config = Precision.default_config()
        # Training data (an Input config); None: pass data to fit().
        train_input: Optional[Input.Config] = None
        # Evaluations run during and after training, by name.
        evalers: Dict[str, Evaler.Config] = {}
        # Where metrics go.
        loggers: Sequence[Logger.Config] = (Basic.default_config(),)
        # Checkpointing; None: no checkpoints.
        checkpoint: Optional[OrbaxCheckpoint.Config] = None
        # SIGTERM / SIGINT: finish the step, save a checkpoint, exit 0 (needs checkpoint).
        save_on_preemption: bool = True
        # Steps to train (fit's `steps` overrides).
        max_steps: Optional[int] = None
        # Global seed of every PRNG stream.
        seed: int = 0
        # Log (and check the loss for NaN/Inf) every this many steps.
        log_every: int = 10
        # Non-finite loss: "stop" raises NonFiniteError naming the step; "skip" leaves the state
        # unchanged for that step and goes on.
        nan_policy: Literal["stop", "skip"] = "stop"
        # A step called with new input shapes/dtypes: "error", "warn" (and recompile) or "allow".
        recompile_policy: Literal["error", "warn", "allow"] = "error"
        # Trace a window of steps with jax.profiler (None: no profile). Switch on from the
        # command line with --config.profile.start_step=N --config.profile.num_steps=K.
        profile: Optional[Profile.Config] = None
        # Steps allowed to execute at once (the next batch is still prepared while one runs).
        # None: 1 on the CPU platform -- simulated devices share the host's threads, and
        # overlapping executions of a program with collectives have deadlocked XLA's in-process
        # rendezvous there -- and unbounded (fully asynchronous dispatch) elsewhere.
        max_inflight_steps: Optional[int] = None

        def _validate_values(self):
            if self.log_every < 1:
                yield "log_every", "must be >= 1"
            if self.max_steps is not None and self.max_steps < 0:
                yield "max_steps", "must be >= 0"

    def __init__(self, cfg=None, *, trainer_dir: Optional[str] = None, hooks: Sequence[Any] = (),
                 **fields):
        """``hooks``: objects with any of ``before_step(step)``, ``on_batch(step, host_batch)``
        and ``after_step(step, metrics)``, called on the host (runtime objects, not config)."""
        super().__init__(cfg, **fields)
        self.trainer_dir = trainer_dir
        self.hooks = list(hooks)
        self.state: Optional[TrainState] = None
        self._built = False
        self._train_step: Optional[CompiledStep] = None
        self._user_step: Optional[Callable] = None
        self._eval_steps: Dict[Any, CompiledStep] = {}
        self._loggers: Optional[List[Logger]] = None
        # Builds, restores and saves self.state, and owns the checkpointer.
        self.states = StateManager(self)
        self.history: List[Dict[str, float]] = []
        # Where the current state came from: None (fresh) or the restored checkpoint's path.
        self.restored_from: Optional[str] = None
        self._restored_data_state: Optional[Dict[str, Any]] = None
        self._train_iterator: Optional[Iterator] = None
        # True once the state came from a full restore (the run continues; nothing is fresh).
        self._resumed = False
        self._checkpoint_dir_claimed = False
        self._loggers_started = False
        # Rows per data shard of the latest batch (the pipeline's microbatch count needs it).
        self._local_batch_rows: Optional[int] = None
        # Called once when training really starts (see run()).
        self._on_start: Optional[Callable[[], None]] = None

    # --- Building ---------------------------------------------------------------------------------

    def build(self) -> "Engine":
        """Mesh, plan checks, model, param layouts and the optimizer (idempotent)."""
        if self._built:
            return self
        cfg = self.config
        self.mesh_spec: MeshSpec = cfg.mesh.instantiate()
        self.mesh = self.mesh_spec.build()
        self.plan: Plan = cfg.plan.instantiate()
        self.plan.validate(self.mesh)
        pp = cfg.plan.pipeline_parallel
        if pp is not None and cfg.model is None:
            raise errors.PlanError(
                "a pipeline runs the engine's model (its stacked layers, or explicit stages over "
                "its params); hand-written steps cannot be pipelined yet",
                path="plan.pipeline_parallel", suggestion="configure a model, or drop "
                "pipeline_parallel")
        self.precision: Precision = cfg.precision.instantiate()
        self.learner: learner_lib.Learner = cfg.learner.instantiate(total_steps=cfg.max_steps)
        tp = cfg.plan.tensor_parallel
        if tp is not None and not tp.prefer_reduce_scatter and \
                getattr(cfg.model, "sequence_parallel", False):
            raise errors.PlanError(
                "the model uses sequence parallelism (reduce-scatter at the end of row-parallel "
                "layers) but the plan sets prefer_reduce_scatter=False",
                path="plan.tensor_parallel.prefer_reduce_scatter",
                suggestion="set model.sequence_parallel=False, or allow reduce-scatter")
        self.model: Optional[BaseLayer] = cfg.model.instantiate() if cfg.model else None
        self.parameter_specs = None
        self.param_specs = None
        # ZeRO / FSDP: per param, the dimension split over the ZeRO axis (None: kept whole).
        self.zero_dims = None
        # The circular schedule's view of the stacked layers (None: params in canonical layout).
        self.stack_view: Optional[InterleavedStack] = None
        if self.model is not None:
            self.parameter_specs = self.model.create_parameter_specs_recursively()
            self.param_specs = self.plan.param_partition_specs(self.parameter_specs, self.mesh)
            self.model.check_partition_specs(self.param_specs)
            if pp is not None:  # Refuses a model or mesh it cannot pipeline, before compiling.
                self._setup_pipeline_check(pp)
            if pp is not None and pp.schedule == "circular" and pp.virtual_stages > 1 \
                    and not pp.stages:
                self.stack_view = InterleavedStack(
                    stacked_layers=pp.stacked_layers,
                    num_layers=self.model.decoder.config.num_layers,
                    num_stages=self.mesh.shape[pp.axis], virtual_stages=pp.virtual_stages,
                    pipe_axis=pp.axis)
                self.parameter_specs = self.stack_view.view_parameter_specs(self.parameter_specs)
                self.param_specs = self.stack_view.view_partition_specs(self.param_specs)
            self._shard_state_dims()
            self._make_adapter(learner_lib.decay_scales_from_specs(self.parameter_specs))
        self._built = True
        return self

    def _shard_state_dims(self) -> None:
        """ZeRO / FSDP: the real dimension of each param that carries the ZeRO axis (last of
        the spec transforms, after TP and the pipeline); FSDP adds it to the params' specs."""
        self.zero_dims = None
        zero = self.plan.zero
        if zero is None:
            return
        axis = self.plan.zero_axis
        self.zero_dims = state_dims.choose_dims(
            self.parameter_specs, self.param_specs, axis=axis,
            axis_size=int(self.mesh.shape[axis]), min_shard_size=zero.config.min_shard_size,
            dim_overrides=tuple(zero.config.dim_overrides.items()))
        if zero.fsdp:
            self.param_specs = state_dims.add_axis(self.param_specs, self.zero_dims, axis)

    def _setup_pipeline_check(self, pp) -> None:
        from titanax.train.pipelined_gradients import PipelinedGradients  # pylint: disable=import-outside-toplevel
        PipelinedGradients(model=self.model, precision=self.precision,
                           mesh_shape=dict(self.mesh.shape), batch_axes=self.plan.batch_axes,
                           pipe_axis=pp.axis, microbatch_size=pp.microbatch_size,
                           schedule=pp.schedule, virtual_stages=pp.virtual_stages,
                           checkpoint_ratio=pp.checkpoint_ratio, stages=pp.stages)

    def _make_adapter(self, decay_scales: Any) -> None:
        if self.config.optimizer is not None:
            self.adapter = learner_lib.OptimizerAdapter(self.config.optimizer)
        else:
            self.adapter = self.learner.build(decay_scales)

    @property
    def axes(self):
        return tuple(self.mesh.axis_names)

    @property
    def data_axis(self) -> Optional[str]:
        return self.plan.dp_axis

    def _setup(self) -> step_lib.StepSetup:
        dp = self.config.plan.data_parallel
        return step_lib.StepSetup(
            model=self.model, precision=self.precision, adapter=self.adapter, learner=self.learner,
            mesh_shape=dict(self.mesh.shape), data_axis=self.data_axis,
            batch_axes=self.plan.batch_axes, accumulate_steps=self.plan.accumulate_steps,
            state_sharding=self.state_sharding, nan_policy=self.config.nan_policy,
            sync_metrics=dp.sync_metrics if dp is not None else True,
            pipeline=self.config.plan.pipeline_parallel)

    # --- State ------------------------------------------------------------------------------------

    def _shard_map(self, fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)

    # --- The train state (kept by self.states) -------------------------------------------------

    def init_state(self, params: Any = None) -> TrainState:
        """A fresh state: params initialised (or ``params`` placed) in their shards."""
        return self.states.init_state(params)

    def init_or_restore(self, *, params: Any = None) -> TrainState:
        """Resumes from the newest good checkpoint (when configured to), else starts fresh."""
        return self.states.init_or_restore(params=params)

    def restore(self, *, params: Any = None, step: Optional[int] = None,
                mode: Optional[str] = None) -> bool:
        """Loads the newest good checkpoint (or ``step``); False when there is none."""
        return self.states.restore(params=params, step=step, mode=mode)

    def save(self, *, data_iterator: Any = None, force: bool = False) -> bool:
        """Starts saving the current state (async when configured); False if it exists already."""
        return self.states.save(data_iterator=data_iterator, force=force)

    def checkpointer(self) -> Optional[OrbaxCheckpoint]:
        return self.states.checkpointer()

    def canonical_params(self) -> Any:
        """The params in the layout checkpoints hold (see StateManager.canonical_params)."""
        return self.states.canonical_params()

    def state_dict(self) -> Dict[str, Any]:
        return self.states.state_dict()

    def state_template(self, params: Any = None) -> TrainState:
        """The train state as ShapeDtypeStructs with this run's shardings (restore targets)."""
        return self.states.state_template(params)

    def state_specs(self) -> TrainState:
        return self.states.state_specs()

    def opt_state_specs(self) -> Any:
        return self.states.opt_state_specs()

    @property
    def state_sharding(self):
        """How the optimizer state is laid out and updated (train/state_sharding.py)."""
        return self.states.state_sharding

    # --- Batches ----------------------------------------------------------------------------------

    def batch_specs(self, batch: Any) -> Any:
        return sharding.shard_batch_specs(batch, self.plan.batch_axis)

    def process_batch_shards(self):
        """``(shards, num_shards)``: the batch shards this process's devices hold, in order.

        A process feeds exactly these rows of every global batch (``batch_shards.py``): with
        one process, all of them; with the model or pipe axis spanning processes, the same
        shards as its peers on that axis."""
        return batch_shards.process_shards(self.mesh, self.plan.batch_axis)

    def global_batch(self, host_batch: Dict[str, np.ndarray]) -> Dict[str, jax.Array]:
        """Global arrays from this process's rows -- the rows of ``process_batch_shards()``, in
        shard order (checked against the plan first)."""
        shards, num_shards = self.process_batch_shards()
        leaves = jax.tree_util.tree_leaves(host_batch)
        if leaves and np.ndim(leaves[0]):
            global_rows = np.shape(leaves[0])[0] // len(shards) * num_shards
            self.plan.check_batch_size(global_rows, self.mesh)
        return batch_shards.place_batch(self.mesh, self.plan.batch_axis, host_batch, shards,
                                        num_shards)

    # --- Compiling --------------------------------------------------------------------------------

    def compile(self, step_fn: Optional[Callable] = None, example_batch: Any = None
                ) -> CompiledStep:
        """The compiled train step (compiled now when ``example_batch`` is given)."""
        self.build()
        if step_fn is not None and step_fn is not self._user_step:
            self._user_step = step_fn
            self._train_step = None
        if self._train_step is None:
            if self.state is None:
                raise errors.StepError("no train state yet", path="engine.state",
                                       suggestion="call init_state() (or fit) first")
            self._train_step = self._make_train_step()
        if example_batch is not None:
            batch = self.global_batch(example_batch) if _is_host(example_batch) else example_batch
            self._train_step.compiled_for(self.state, batch)
        return self._train_step

    def _make_train_step(self) -> CompiledStep:
        state_specs = self.state_specs()
        if self._user_step is not None and self.plan.pp_axis is not None:
            raise errors.PlanError(
                "a hand-written @step_fn cannot run a pipeline yet: it would see each stage's "
                "slice of the stacked layers", path="plan.pipeline_parallel",
                suggestion="train the configured model (fit() without a step function), or drop "
                           "pipeline_parallel")
        if self._user_step is None and self.model is None:
            raise errors.StepError("no model and no step function", path="engine.model",
                                   suggestion="configure a model, or pass a @step_fn to fit")
        local_step = self._local_step(self._user_step)
        local, metric_spec = local_step.train, local_step.metric_spec

        def specs_for(batch):
            return self.batch_specs(batch)

        def step(state, batch):
            return self._shard_map(local, in_specs=(state_specs, specs_for(batch)),
                                   out_specs=(state_specs, metric_spec))(state, batch)

        return CompiledStep(jax.jit(step, donate_argnums=0), name="train step",
                            policy=self.config.recompile_policy)

    def _local_step(self, step_fn: Optional[Callable]):
        """The local-step protocol's implementation: the model's step, or the user's."""
        if step_fn is None:
            return step_lib.ModelStep(self._setup())
        if self.plan.zero is not None:
            raise errors.PlanError(
                "ZeRO / FSDP lay out and update the state inside the engine's model step; a "
                "hand-written @step_fn applies its gradients to the whole state itself",
                path="plan.zero", suggestion="drop plan.zero for this step, or configure a "
                "model and let the engine run its step")
        return UserStep(step_fn, axes=self.axes, data_axis=self.data_axis,
                        param_specs=self.param_specs, precision=self.precision)

    # --- Running ----------------------------------------------------------------------------------

    def train_step(self, host_batch: Any) -> Dict[str, jax.Array]:
        """One step on a host batch; updates ``self.state``; returns the device metrics."""
        batch = self.global_batch(host_batch) if _is_host(host_batch) else host_batch
        rows = jax.tree_util.tree_leaves(batch)[0].shape[0]
        self._local_batch_rows = rows // self.plan.batch_shards(self.mesh)
        self.state, metrics = self.compile()(self.state, batch)
        return metrics

    def fit(self, step_fn: Optional[Callable] = None, data: Optional[Iterable] = None,
            steps: Optional[int] = None, eval_every: Optional[int] = None, *,
            params: Any = None) -> TrainState:
        """Trains for ``steps`` (default ``max_steps``) on ``data`` (default ``train_input``)."""
        self.build()
        cfg = self.config
        if step_fn is not None:
            self._user_step = step_fn
            self._train_step = None
        total = steps if steps is not None else cfg.max_steps
        if total is None:
            raise errors.StepError("how many steps?", path="engine.max_steps",
                                   suggestion="set max_steps or pass steps= to fit()")
        if isinstance(total, bool) or not isinstance(total, (int, np.integer)) or total < 0:
            raise errors.StepError(f"the number of steps must be an int >= 0, got {total!r}",
                                   path="fit(steps=...)" if steps is not None else "max_steps",
                                   suggestion="pass the step to train up to, e.g. steps=1000")
        if data is None:
            self.check_inputs()
        if self.state is None:
            self.init_or_restore(params=params)
        # Everything that can still fail comes first (the data source is opened here); only
        # then does the run leave traces: the checkpoint dir claimed (or the old run moved
        # aside), loggers started, the config record written.
        if data is not None:
            iterator = iter(data)
        else:  # The configured input: one stream per engine, continued by later fit() calls.
            if self._train_iterator is None:
                self._train_iterator = iter(self._make_input(cfg.train_input,
                                                             where="train_input"))
            iterator = self._train_iterator
        if self._restored_data_state and hasattr(iterator, "set_state"):
            iterator.set_state(self._restored_data_state)
            self._restored_data_state = None
        preemption.exit_if_requested("before the first step")
        self._claim_checkpoint_dir()
        self._start_loggers(total)
        on_start, self._on_start = self._on_start, None
        if on_start is not None and int(jax.device_get(self.state.step)) < total \
                and jax.process_index() == 0:
            on_start()  # The run really trains: the launcher writes its config record now.
        with preemption_guard(True) as guard:
            self._train_loop(iterator, total, eval_every, guard)
        return self.state

    def _train_loop(self, iterator, total: int, eval_every: Optional[int], guard) -> None:
        cfg = self.config
        start_step = int(jax.device_get(self.state.step))
        profiler = (cfg.profile.instantiate(trainer_dir=self.trainer_dir)
                    if cfg.profile is not None else None)
        try:
            self._run_steps(iterator, start_step, total, eval_every, guard, profiler)
        finally:
            if profiler is not None:
                profiler.stop()

    def _run_steps(self, iterator, start_step: int, total: int, eval_every: Optional[int], guard,
                   profiler: Optional[Profile]) -> None:
        cfg = self.config
        ckpt = self.checkpointer()
        loggers = self.loggers()
        pending: List[Dict[str, jax.Array]] = []
        window_start = time.perf_counter()
        window_steps = 0
        compiled_at_start = None
        inflight: List[Any] = []
        limit = self._inflight_limit()
        for index in range(start_step, total):
            for hook in self.hooks:
                if hasattr(hook, "before_step"):
                    hook.before_step(index)
            try:
                host_batch = next(iterator)  # Prepared while the previous step still runs.
            except StopIteration:
                print(f"titanax: the training data ran out after step {index}", flush=True)
                break
            for hook in self.hooks:
                if hasattr(hook, "on_batch"):
                    hook.on_batch(index, host_batch)
            while limit is not None and len(inflight) >= limit:
                jax.block_until_ready(inflight.pop(0))
            if profiler is not None:
                profiler.before_step(index + 1, in_flight=inflight)
            metrics = self.train_step(host_batch)
            inflight.append(metrics)
            if profiler is not None:
                profiler.after_step(index + 1, (self.state, metrics))
            if compiled_at_start is None:
                jax.block_until_ready(metrics)
                compiled_at_start = True
                window_start = time.perf_counter()
                window_steps = 0
                self._log_compile(loggers, index)
            else:
                window_steps += 1
            pending.append(metrics)
            done = index + 1
            if done % cfg.log_every == 0 or done == total:
                self._flush(pending, done, window_start, window_steps, total, loggers)
                pending.clear()
                window_start, window_steps = time.perf_counter(), 0
            for hook in self.hooks:
                if hasattr(hook, "after_step"):
                    hook.after_step(done, metrics)
            if eval_every and done % eval_every == 0 or self._evalers_due(done):
                jax.block_until_ready(inflight)
                inflight.clear()
                self.run_evalers(done, only_due=not (eval_every and done % eval_every == 0))
                self._last_eval_step = done
            saving = ckpt is not None and cfg.save_on_preemption
            stop = guard.should_stop(done)  # (Every process asks at every step.)
            if ckpt is not None and (ckpt.should_save(done) or stop and saving):
                self.save(data_iterator=iterator)
            if stop:
                self._stop_on_signal(guard, done, saved=saving)
        jax.block_until_ready(inflight)
        if pending:
            self._flush(pending, int(jax.device_get(self.state.step)),
                        window_start, window_steps, total, loggers)
        if ckpt is not None:
            if ckpt.config.save_at_end:
                self.save(data_iterator=iterator)  # A no-op when this step is saved already.
            verified = ckpt.wait_until_finished()  # Raises unless every save is committed.
            if verified and jax.process_index() == 0:
                print(f"titanax: saved and verified step(s) {verified} in {ckpt.directory}",
                      flush=True)

    def _stop_on_signal(self, guard, done: int, *, saved: bool) -> None:
        """After a SIGTERM / SIGINT: exit 0 once this step is verified on disk; without a
        checkpoint to save to, stop anyway (status 128 + signal: the steps since the start or
        the last save are lost, and the scheduler should know)."""
        ckpt = self.checkpointer()
        if saved:
            ckpt.wait_until_finished()  # Raises unless every save in flight is committed.
            print(f"titanax: {guard.signal_name}: saved step {done} to {ckpt.directory}; "
                  "exiting", flush=True)
            raise SystemExit(0)
        why = ("no checkpoint is configured" if ckpt is None
               else "save_on_preemption is off")
        print(f"titanax: {guard.signal_name}: stopped after step {done}; {why}, so nothing was "
              "saved", flush=True)
        raise SystemExit(128 + int(getattr(signal, guard.signal_name.split()[0])))

    def _inflight_limit(self) -> Optional[int]:
        limit = self.config.max_inflight_steps
        if limit is None and self.mesh.devices.flat[0].platform == "cpu":
            return 1
        return limit

    def _log_compile(self, loggers, step: int) -> None:
        compiled = self._train_step
        seconds = compiled.compile_seconds[-1] if compiled.compile_seconds else 0.0
        _log.info("compiled the train step in %.2fs", seconds)
        for logger in loggers:
            logger.log_dict({"compile_time_s": seconds}, step)

    def _flush(self, pending, step, window_start, window_steps, total, loggers) -> None:
        values = [{k: _first_value(v) for k, v in m.items()} for m in pending]
        # Timed once the values are read: reading waits for the window's last step to finish
        # (timed at dispatch, a log line every step showed ~20x the real speed on CPU).
        elapsed = time.perf_counter() - window_start
        first_step = step - len(values) + 1
        for offset, m in enumerate(values):
            # The step's own verdict covers every device (with sync_metrics=False "loss" is
            # only this process's first shard): every process stops alike.
            finite = m["loss_finite"] > 0 if "loss_finite" in m else math.isfinite(m["loss"])
            if not finite and self.config.nan_policy == "stop":
                shown = (f"the loss is {m['loss']}" if not math.isfinite(m["loss"])
                         else "the loss is not finite on another data shard")
                raise errors.NonFiniteError(
                    f"{shown} at step {first_step + offset}",
                    path=f"step {first_step + offset}",
                    suggestion="lower the learning rate, enable clipping (learner.max_grad_norm) "
                               "or loss scaling, or set nan_policy='skip'")
        self.history.extend(values)
        last = dict(values[-1])
        step_time = elapsed / window_steps if window_steps else None
        if window_steps:  # The compile step alone has no step time to show.
            last["step_time_s"] = step_time
            if "aux/num_tokens" in last:
                last["tokens_per_s"] = last["aux/num_tokens"] / step_time
            elif "aux/num_examples" in last:
                last["examples_per_s"] = last["aux/num_examples"] / step_time
        flops = self._train_step.latest_flops if self._train_step else None
        if flops is not None and window_steps:
            last["tflops_per_device"] = flops / step_time / 1e12
            utilisation = throughput.mfu(flops, step_time)
            if utilisation is not None:
                last["mfu"] = utilisation
        if window_steps:
            last["eta_s"] = (total - step) * step_time
        pp = self.config.plan.pipeline_parallel
        if pp is not None and self._local_batch_rows:
            last["pipeline_bubble"] = pipeline_report.schedule_numbers(
                pp, num_stages=self.mesh.shape[pp.axis], local_batch=self._local_batch_rows)[2]
        if self._train_step is not None and self._train_step.compile_seconds:
            last["compile_time_s"] = sum(self._train_step.compile_seconds)
            peak = memory.watermark_bytes(self._train_step.latest_step_bytes)
            if peak is not None:
                last["peak_memory_gib"] = peak / 2 ** 30
        for logger in loggers:
            logger.log_dict(last, step)

    def _claim_checkpoint_dir(self) -> None:
        """Before the first step or save: a run that did not resume must not write into a
        directory holding another run's checkpoints (refused, or moved aside on request)."""
        ckpt = self.checkpointer()
        if ckpt is None or self._checkpoint_dir_claimed:
            return
        if not self._resumed:
            ckpt.prepare_fresh_start()
        self._checkpoint_dir_claimed = True

    def _start_loggers(self, total: int) -> None:
        if self._loggers_started:
            return
        step = int(jax.device_get(self.state.step))
        for logger in self.loggers():
            logger.start(step=step, total_steps=total, resumed=self._resumed)
        self._loggers_started = True

    def check_inputs(self) -> None:
        """Every configured input against the plan, before the first step is spent."""
        self.build()
        cfg = self.config
        if cfg.train_input is not None and isinstance(cfg.train_input.global_batch_size, int):
            self.plan.check_batch_size(cfg.train_input.global_batch_size, self.mesh,
                                       path="train_input.global_batch_size")
        for name, evaler_cfg in cfg.evalers.items():
            batch = evaler_cfg.input.global_batch_size
            if isinstance(batch, int):
                self.plan.check_batch_size(batch, self.mesh, microbatched=False,
                                           path=f"evalers[{name!r}].input.global_batch_size")

    # --- Evaluation -------------------------------------------------------------------------------

    def evalers(self) -> Dict[str, Evaler]:
        if not hasattr(self, "_evalers"):
            self._evalers = {name: cfg.clone(name=name).instantiate()
                             for name, cfg in self.config.evalers.items()}
        return self._evalers

    def _evalers_due(self, step: int) -> bool:
        return any(e.due(step) for e in self.evalers().values())

    def run_evalers(self, step: int, *, only_due: bool = True) -> Dict[str, Dict[str, float]]:
        results = {}
        for name, evaler in self.evalers().items():
            if only_due and not evaler.due(step):
                continue
            data = self._make_input(evaler.config.input, where=f"evalers[{name!r}].input")
            metrics = self.eval(data=data, steps=evaler.config.num_batches)
            results[name] = metrics
            for logger in self.loggers():
                logger.log_dict({f"{name}/{k}": v for k, v in metrics.items()}, step)
        self._last_eval_results = results
        return results

    def eval(self, step_fn: Optional[Callable] = None, data: Optional[Iterable] = None,
             steps: Optional[int] = None) -> Dict[str, float]:
        """Forward-only metrics over ``steps`` batches of ``data`` (all of it when steps=None)."""
        self.build()
        compiled = self._eval_step(step_fn)
        totals: Dict[str, float] = {}
        count = 0
        for index, host_batch in enumerate(data):
            if steps is not None and index >= steps:
                break
            preemption.stop_if_requested("the evaluation is cut short (checkpoints are saved)")
            batch = self.global_batch(host_batch) if _is_host(host_batch) else host_batch
            metrics = jax.device_get(compiled(self.state.params, batch))
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + float(np.asarray(value).reshape(-1)[0])
            count += 1
        if count == 0:
            raise errors.DataError("the eval data produced no batch", path="eval data",
                                   suggestion="check the eval input and num_batches")
        return summarize(totals, count)

    def _eval_step(self, step_fn: Optional[Callable]) -> CompiledStep:
        key = step_fn or "model"
        if key not in self._eval_steps:
            local = self._local_step(step_fn).eval

            def run(params, batch):
                return self._shard_map(local, in_specs=(self.param_specs, self.batch_specs(batch)),
                                       out_specs=PartitionSpec())(params, batch)

            self._eval_steps[key] = CompiledStep(jax.jit(run), name="eval step", policy="allow")
        return self._eval_steps[key]

    # --- Reports ----------------------------------------------------------------------------------

    def collectives(self) -> List[hlo.CollectiveOp]:
        """Every collective of the compiled train step (compile it first)."""
        if self._train_step is None or self._train_step.latest is None:
            raise errors.StepError("the train step is not compiled yet", path="engine",
                                   suggestion="call compile(example_batch=...) or train a step")
        return hlo.collectives_report(self._train_step.latest.as_text(), self.mesh)

    def explain(self) -> str:
        """Mesh, plan with every param's layout, and the compiled step's collectives."""
        self.build()
        parts = [describe_mesh(self.mesh)]
        if self.parameter_specs is not None:
            parts.append(self.plan.describe(self.parameter_specs, self.mesh,
                                            specs=self.param_specs))
        if self.plan.pp_axis is not None and self.model is not None:
            parts.append(self._describe_pipeline())
        if self.parameter_specs is not None and self.model is not None:
            parts.append(self._describe_state())
        if self._train_step is not None and self._train_step.latest is not None:
            ops = self.collectives()
            parts.append("collectives of the train step:\n" + hlo.format_report(ops) + "\n"
                         + hlo.format_totals_by_axis(ops))
        return "\n\n".join(parts)

    def _describe_state(self) -> str:
        zero = self.plan.zero
        strategy = self.state_sharding
        return state_report.describe(
            parameter_specs=self.parameter_specs, param_specs=self.param_specs,
            grad_specs=strategy.grad_specs, opt_state=self.state_template().opt_state,
            mesh_shape=dict(self.mesh.shape),
            itemsize=np.dtype(self.precision.param_dtype).itemsize,
            stage=zero.config.stage if zero else None, axis=strategy.shard_axis,
            dims=self.zero_dims, grad_sync=zero.config.grad_sync if zero else None)

    def _describe_pipeline(self) -> str:
        pp = self.config.plan.pipeline_parallel
        compiled = self._train_step.latest if self._train_step is not None else None
        analysis = compiled.memory_analysis() if compiled is not None else None
        temp = getattr(analysis, "temp_size_in_bytes", None) if analysis else None
        if pp.stages:
            owned = stages_lib.owners(self.parameter_specs, pp.stages)
            flat = sharding.flat_paths(self.parameter_specs, is_leaf=rules.is_param_leaf)
            itemsize = np.dtype(self.precision.param_dtype).itemsize
            per_stage = [(stage.name, sorted(p for p, i in owned.items() if i == index),
                          sum(int(np.prod(flat[p].shape)) * itemsize
                              for p, i in owned.items() if i == index))
                         for index, stage in enumerate(pp.stages)]
            return pipeline_report.describe_stages(
                pp, num_stages=self.mesh.shape[pp.axis], stages=per_stage,
                local_batch=self._local_batch_rows, temp_bytes=temp)
        stacked = self.parameter_specs
        for part in pp.stacked_layers.split("/"):
            stacked = stacked[part]
        specs = self.param_specs
        for part in pp.stacked_layers.split("/"):
            specs = specs[part]
        itemsize = np.dtype(self.precision.param_dtype).itemsize
        leaves = jax.tree_util.tree_leaves(stacked, is_leaf=rules.is_param_leaf)
        spec_leaves = jax.tree_util.tree_leaves(specs,
                                                is_leaf=lambda x: isinstance(x, PartitionSpec))
        unsplit = sum(int(np.prod(s.shape)) * itemsize for s in leaves)
        local = sum(int(np.prod(rules.local_shape(s.shape, spec, dict(self.mesh.shape))))
                    * itemsize for s, spec in zip(leaves, spec_leaves))
        return pipeline_report.describe(
            pp, num_stages=self.mesh.shape[pp.axis],
            num_layers=self.model.decoder.config.num_layers, local_batch=self._local_batch_rows,
            stacked_bytes_per_device=local, unsplit_stacked_bytes=unsplit, temp_bytes=temp)

    # --- Launcher entry point ---------------------------------------------------------------------

    def loggers(self) -> List[Logger]:
        if self._loggers is None:
            self._loggers = [cfg.instantiate(trainer_dir=self.trainer_dir)
                             for cfg in self.config.loggers] if jax.process_index() == 0 else []
        return self._loggers

    def _make_input(self, input_cfg: Optional[Input.Config], *, where: str) -> Input:
        """``where``: the config path of ``input_cfg`` (errors name the full path)."""
        if input_cfg is None:
            raise errors.DataError("no training data", path="engine.train_input",
                                   suggestion="set train_input, or pass data= to fit()")
        try:
            shards, num_shards = self.process_batch_shards()
            return input_cfg.instantiate(shards=shards, num_shards=num_shards)
        except errors.DataError as e:
            in_source = input_cfg.source is not None and e.path in input_cfg.source.keys()
            inner = (f"{where}.source.{e.path}" if e.path and in_source
                     else f"{where}.{e.path}" if e.path else where)
            raise errors.DataError(e.message, path=inner, suggestion=e.suggestion) from None

    def run(self, *, trainer_dir: Optional[str] = None, cluster=None, explain: bool = False,
            on_start: Optional[Callable[[], None]] = None) -> int:
        """What ``python -m titanax.launch`` calls: join the job, train, evaluate, report.

        With ``explain`` it only compiles the train step on the first batch and prints
        ``explain()`` (mesh, param layouts, collectives). ``on_start`` is called (on process 0)
        once everything was checked and the run really starts: the launcher writes the run's
        config record there.
        """
        from titanax.runtime import distributed  # pylint: disable=import-outside-toplevel
        if cluster is not None and cluster.is_multi_process:  # (The launcher has joined.)
            distributed.initialize(spec=cluster)
        self.trainer_dir = trainer_dir or self.trainer_dir
        self.build()
        if self.model is None:
            raise errors.StepError(
                "this experiment has no model, so the launcher has nothing to train",
                path="model", suggestion="set model in the experiment's Engine config (e.g. "
                "GPT.default_config() or MLPClassifier.default_config()); to train a "
                "hand-written @step_fn, call engine.fit(step_fn, data=...) from a script")
        self.check_inputs()
        preemption.exit_if_requested("while the run was built")
        if explain:  # Shapes are all it needs: fresh params, no checkpoint read.
            self.init_state()
            self.compile(example_batch=next(iter(self._make_input(self.config.train_input,
                                                                  where="train_input"))))
            if on_start is not None and jax.process_index() == 0:
                on_start()
            print(self.explain(), flush=True)
            return 0
        self._on_start = on_start
        print(describe_mesh(self.mesh).splitlines()[0], flush=True)
        started = time.perf_counter()
        self.fit()
        step = int(jax.device_get(self.state.step))
        results = (self._last_eval_results if getattr(self, "_last_eval_step", None) == step
                   else self.run_evalers(step, only_due=False))
        for name, metrics in results.items():
            text = "  ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
            print(f"final {name}: {text}", flush=True)
        if self._train_step is None:
            where = self.checkpointer().directory if self.checkpointer() else "this run"
            print(f"nothing to train: the run in {where} is already at step {step} "
                  f"(max_steps {self.config.max_steps}). To train it further raise "
                  "--config.max_steps; to start a new run use another --trainer_dir (or "
                  "--config.checkpoint.resume=never --config.checkpoint.overwrite=true, which "
                  "moves the old checkpoints aside)", flush=True)
        else:
            print(f"trained to step {step} of {self.config.max_steps} in "
                  f"{time.perf_counter() - started:.1f}s (train-step compile "
                  f"{sum(self._train_step.compile_seconds):.1f}s)", flush=True)
        self.close()
        return 0

    def close(self) -> None:
        """Waits for checkpoint writes and closes the checkpointer and loggers."""
        self.states.close()
        for logger in self._loggers or []:
            logger.close()


def _first_value(value: Any) -> float:
    """A metric as a Python float: its value, or -- per data shard (``sync_metrics=False``) --
    the first shard this process holds (another process's shards are not addressable here)."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        first = min(value.addressable_shards,
                    key=lambda shard: tuple(s.start or 0 for s in shard.index))
        value = first.data
    return float(np.asarray(jax.device_get(value)).reshape(-1)[0])


def _is_host(batch: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(batch)
    return bool(leaves) and not isinstance(leaves[0], jax.Array)
