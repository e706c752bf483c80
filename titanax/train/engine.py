"""Engine: builds a run from its config and trains it.

Two ways in, one engine:

* Config-driven: ``Engine.Config`` with a ``model`` (a BaseLayer config whose ``forward(batch)``
  returns ``(loss, aux)``), a plan and a learner; ``python -m titanax.launch --config=NAME`` calls
  ``run()``. The train step is Titanax's (``titanax.train.step``).
* Imperative (the seed's UX): ``Engine(mesh=..., plan=..., optimizer=optax.adamw(3e-4), ...)`` and
  ``engine.fit(train_step, data=..., steps=...)`` with a hand-written ``@step_fn``.

The Engine is a facade over parts that each own one concern: the layout pipeline
(``parallel/layout.py``: where every param and its state live), the state manager (build,
restore, save), the step builder (the compiled ``jit(shard_map(...))`` steps), the training loop,
the metrics window, evaluation and ``explain``. It never asks which parallel kinds the plan uses.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Dict, Iterable, List, Literal, Optional, Sequence

import jax
import numpy as np

from titanax import errors
from titanax.config import Configurable
from titanax.data.pipeline import Input
from titanax.io.checkpointer import OrbaxCheckpoint
from titanax.parallel import axis_binding
from titanax.modules import converters as converters_lib
from titanax.modules.base_layer import BaseLayer
from titanax.observe import goodput, hlo
from titanax.observe.loggers import Basic, Logger
from titanax.observe.profiler import Profile
from titanax.parallel.plan import DP, Plan
from titanax.runtime.mesh import MeshSpec
from titanax.train import evaluation as evaluation_lib
from titanax.train import explain as explain_lib
from titanax.train import learner as learner_lib
from titanax.train import preemption, run_entry, run_parts, starting_params
from titanax.train.compiled_step import CompiledStep
from titanax.train.evaler import Evaler
from titanax.train.inputs import RunInputs, complete_from_train_input
from titanax.train.objective import ModelLoss, Objective, PlainBatches
from titanax.train.precision import Precision
from titanax.train.train_state import TrainState


class Engine(Configurable):
    """A training run: mesh, plan, model or step, learner, precision, data, loggers, evalers."""

    class Config(converters_lib.ConverterFields):
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
        # Entries of a dict of configs the command line may create by their key (an override
        # below a key the dict lacks): --config.evalers['lm_eval'].tasks=[...] adds an lm-eval
        # evaler (titanax/harness/evaler.py) to the run.
        new_entries: ClassVar[Dict[str, Dict[str, str]]] = {
            "evalers": {"lm_eval": "titanax.harness.evaler.LMEvalEvaler"}}
        # Where metrics go.
        loggers: Sequence[Logger.Config] = (Basic.default_config(),)
        # Checkpointing; None: no checkpoints.
        checkpoint: Optional[OrbaxCheckpoint.Config] = None
        # SIGTERM / SIGINT: finish the step, save a checkpoint, exit 0 (needs checkpoint).
        save_on_preemption: bool = True
        # Steps to train (fit's `steps` overrides).
        max_steps: Optional[int] = None
        # A Hugging Face model directory (config.json + *.safetensors) to start from: the
        # launcher takes the model's architecture from its config.json (titanax/hf/fine_tune.py)
        # and a fresh run loads its weights at step 0 with a fresh optimizer; a run with
        # checkpoints of its own resumes from those. None: params from the model's initializers.
        init_from: Optional[str] = None
        # What the model is trained toward (train/objective.py): its own loss, or an objective
        # of titanax/objectives/ with the frozen models and the batches it needs. (The model
        # converters' fields come from converters.ConverterFields.)
        objective: Objective.Config = ModelLoss.default_config()
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
        # None: 1 on CPU (simulated devices share the host's threads; overlapping programs with
        # collectives deadlocked XLA's in-process rendezvous there), unbounded elsewhere.
        max_inflight_steps: Optional[int] = None

        def completed(self) -> "Engine.Config":
            """Evalers' inputs and an unset ``model.vocab_size`` from the train input's."""
            return complete_from_train_input(self)

        def _validate_values(self):
            if self.log_every < 1:
                yield "log_every", "must be >= 1"
            if self.max_steps is not None and self.max_steps < 0:
                yield "max_steps", "must be >= 0"
            if not 0 <= self.seed < 2 ** 32:
                # jax's PRNGKey keeps 32 bits of a seed: 2**32 would be seed 0 again.
                yield "seed", f"must be in [0, 2**32), got {self.seed}"
            if self.max_inflight_steps is not None and self.max_inflight_steps < 1:
                yield "max_inflight_steps", (f"must be >= 1 (or None: the platform's default), "
                                             f"got {self.max_inflight_steps}")

    def __init__(self, cfg=None, *, trainer_dir: Optional[str] = None, hooks: Sequence[Any] = (),
                 **fields):
        """``hooks``: objects with any of ``before_step(step)``, ``on_batch(step, host_batch)``
        and ``after_step(step, metrics)``, called on the host (runtime objects, not config).
        Evalers' inputs and an unset ``model.vocab_size`` follow the train input's where they
        leave it to (``Config.completed``), however the Engine is built."""
        super().__init__(cfg.completed() if isinstance(cfg, Engine.Config) else cfg, **fields)
        self.trainer_dir = trainer_dir
        self.hooks = list(hooks)
        self.state: Optional[TrainState] = None
        self.history: List[Dict[str, float]] = []
        # Where the current state came from: None (fresh) or the restored checkpoint's path.
        self.restored_from: Optional[str] = None
        # Set by build (hand-written steps: once their params are known).
        self.layout = self.states = self.steps = None
        self.frozen_keys: tuple = ()  # The objective's frozen models' params keys (build).
        # Whether sampled completions are shown and recorded (samples.jsonl); off for --explain,
        # which samples a rollout only for the shapes of the step it compiles.
        self.records_samples = True
        self._built = self._resumed = self._dir_claimed = self._loggers_started = False
        self._train_step: Optional[CompiledStep] = None
        self._user_step: Optional[Callable] = None
        self._eval_steps: Dict[Any, CompiledStep] = {}
        self._loggers: Optional[List[Logger]] = None
        self._checkpointer: Optional[OrbaxCheckpoint] = None
        self._restored_data_state: Optional[Dict[str, Any]] = None
        self._train_iterator = None
        self._local_batch_rows: Optional[int] = None  # Rows per batch shard of the latest batch.
        self.evaluation = evaluation_lib.Evaluation(self.config.evalers)

    # --- Building ------------------------------------------------------------------------------

    def build(self) -> "Engine":
        """Mesh, plan checks, model, the layout and the optimizer (idempotent)."""
        if self._built:
            return self
        cfg = self.config
        self.mesh = cfg.mesh.instantiate().build()
        self.plan: Plan = cfg.plan.instantiate()
        self.plan.validate(self.mesh)
        self.precision: Precision = cfg.precision.instantiate()
        self.learner = cfg.learner.instantiate(total_steps=cfg.max_steps)
        self.model: Optional[BaseLayer] = cfg.model.instantiate() if cfg.model else None
        # The model converters (modules/converters.py) and the objective.
        self.converters = converters_lib.instantiate_converters(cfg, model=self.model)
        self.objective: Objective = cfg.objective.instantiate()
        if self.model is not None:
            self.objective.check(self)
        elif not isinstance(self.objective, ModelLoss):
            raise errors.ConfigError(
                f"the {self.objective.name} objective trains a configured model; a hand-written "
                "step has none", path="objective",
                suggestion="configure a model, or leave the objective the model's loss")
        limits = getattr(self.model, "input_limits", None)
        self.inputs = RunInputs(mesh=self.mesh, plan=self.plan, limits=self.objective.input_limits(
            limits() if limits is not None else None))
        for evaler in self.evaluation.evalers.values():  # (Those that check the run.)
            if hasattr(evaler, "check_engine"):
                evaler.check_engine(self)
        if self.model is not None:
            self.plan.check_model(self.model, self.mesh)
            # The layers' logical dimensions take their mesh axes from the plan's binding.
            with axis_binding.bound(self.plan.axis_binding()):
                self._set_layout(self.model_specs())
        self._built = True
        return self

    def model_specs(self) -> Any:
        """The params' ParameterSpecs: the model's as its converters make them, and the
        objective's frozen models under keys of their own."""
        own = self.model.create_parameter_specs_recursively()
        specs = converters_lib.convert_specs(self.converters, own, model=self.model)
        frozen = self.objective.frozen_specs(own, run=self)
        self.frozen_keys = tuple(frozen)
        return dict(specs, **frozen)

    def own_params(self, params: Any) -> Any:
        """``params`` (or specs) of the model itself: without the objective's frozen models and
        what the converters added (what a Hugging Face directory holds)."""
        return converters_lib.own_params(
            self.converters, {k: v for k, v in params.items() if k not in self.frozen_keys})

    def _set_layout(self, parameter_specs: Any) -> None:
        """The layout pipeline over ``parameter_specs``, and the parts that read it."""
        self.layout = self.plan.layout(parameter_specs, self.mesh)
        if self.model is not None:
            with axis_binding.bound(self.layout.axis_binding):
                self.model.check_partition_specs(self.layout.layer_specs,
                                                 mesh_shape=self.layout.mesh_shape)
        self.states, self.steps = run_parts.state_and_steps(self, parameter_specs)

    def _declare(self, params: Any) -> None:
        """Layouts for a hand-written step's params (the plan's rules over their shapes)."""
        self.build()
        if self.layout is None and params is not None:
            self._set_layout(jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.asarray(x).dtype), params))
        if self.layout is None:
            raise errors.StepError("there is no model to initialise params from",
                                   path="engine.model",
                                   suggestion="pass params= to fit() or init_state()")

    @property
    def axes(self):
        return tuple(self.mesh.axis_names)

    @property
    def param_specs(self) -> Any:
        return self.layout.param_specs if self.layout is not None else None

    @property
    def parameter_specs(self) -> Any:
        return self.layout.parameter_specs if self.layout is not None else None

    # --- The train state (built, restored and saved by self.states) -----------------------------

    def init_state(self, params: Any = None) -> TrainState:
        """A fresh state: params initialised (or ``params`` placed) in their shards; the
        objective's frozen models, when initialised here, from the starting weights (or their
        own directories)."""
        self._declare(params)
        self.state = self.states.init_state(params)
        if params is None and self.model is not None:
            frozen = self.objective.frozen_params(start=self.own_params(self.state.params),
                                                  run=self)
            if frozen:
                self.state = self.state.replace(params=dict(self.state.params, **frozen))
        return self.state

    def frozen_from_hf(self, directory: str, *, key: str, model: Any = None) -> Any:
        """The HF ``directory``'s weights as the frozen model under params ``key`` (of
        ``model``'s architecture; default the run's: ``starting_params.frozen_from_hf``)."""
        return starting_params.frozen_from_hf(self, directory, key=key, model=model)

    def restore(self, *, params: Any = None, step: Optional[int] = None,
                mode: Optional[str] = None) -> bool:
        """Loads the newest good checkpoint (or ``step``); False when there is none. ``params``
        (hand-written steps) give the param tree's structure; mode "params": only the params."""
        self._declare(params)
        restored = self.states.restore(step=step, mode=mode,
                                       config_text=self.config.debug_string())
        if restored is None:
            return False
        self.state, self.restored_from = restored.state, restored.path
        if restored.resumed:
            self._resumed, self._restored_data_state = True, restored.data_state
        return True

    def init_or_restore(self, *, params: Any = None) -> TrainState:
        """Resumes from the newest good checkpoint (when configured to), else starts fresh."""
        ckpt = self.checkpointer()
        if not (ckpt is not None and ckpt.config.resume == "auto" and self.restore(params=params)):
            if params is None and self.config.init_from is not None:
                params = starting_params.params_from_hf(self)
            self.init_state(params)
        return self.state

    def save(self, *, data_iterator: Any = None, force: bool = False, local: bool = False
             ) -> bool:
        """Starts saving the current state (async when configured); False if it exists already.
        ``local``: to the local tier (checkpoint.local_dir)."""
        self._claim_checkpoint_dir()
        return self.states.save(
            self.state, force=force, local=local,
            data_state=data_iterator.get_state() if hasattr(data_iterator, "get_state") else None,
            config_text=self.config.debug_string(),
            optimizer_text=self.config.learner.debug_string() + repr(type(self.config.optimizer)))

    def checkpointer(self) -> Optional[OrbaxCheckpoint]:
        if self._checkpointer is None and self.config.checkpoint is not None:
            self._checkpointer = self.config.checkpoint.instantiate(trainer_dir=self.trainer_dir)
        return self._checkpointer

    def _claim_checkpoint_dir(self) -> None:
        """Before the first step or save: a run that did not resume must not write into a
        directory holding another run's checkpoints (refused, or moved aside on request)."""
        ckpt = self.checkpointer()
        if ckpt is not None and not self._dir_claimed:
            if not self._resumed:
                ckpt.prepare_fresh_start()
            self._dir_claimed = True

    def canonical_params(self) -> Any:
        """The params in the layout checkpoints hold and every mesh shares."""
        return self.states.canonical_params(self.state.params)

    def state_dict(self) -> Dict[str, Any]:
        """The train state as a plain dict of global arrays, in the run's own layout."""
        s = self.state
        return {"params": s.params, "opt_state": s.opt_state, "step": s.step, "rngs": s.rngs,
                "loss_scale": s.loss_scale}

    def state_template(self, params: Any = None) -> TrainState:
        """The train state as ShapeDtypeStructs with this run's shardings (restore targets)."""
        self._declare(params)
        return self.states.state_template()

    # --- Batches (self.inputs) ----------------------------------------------------------------

    def process_batch_shards(self):
        """``(shards, num_shards)``: the batch shards this process's devices hold, in order."""
        return self.build().inputs.process_batch_shards()

    def global_batch(self, host_batch: Dict[str, np.ndarray]) -> Dict[str, jax.Array]:
        """Global arrays from this process's rows (checked against the plan first)."""
        return self.build().inputs.global_batch(host_batch)

    def check_inputs(self) -> None:
        """Every configured input against the plan, before the first step is spent."""
        self.build().inputs.check(self.config)

    def make_input(self, input_cfg: Optional[Input.Config], *, where: str,
                   source: Any = None) -> Input:
        """The input of ``input_cfg`` for this process's rows; errors name ``where``;
        ``source``: its source already built (by another input of the same source config)."""
        return self.build().inputs.make(input_cfg, where=where, source=source)

    # --- Steps ---------------------------------------------------------------------------------

    def compile(self, step_fn: Optional[Callable] = None, example_batch: Any = None
                ) -> CompiledStep:
        """The compiled train step (compiled now when ``example_batch`` is given)."""
        self.build()
        if step_fn is not None and step_fn is not self._user_step:
            self._user_step, self._train_step = step_fn, None
        if self._train_step is None:
            if self.state is None:
                raise errors.StepError("no train state yet", path="engine.state",
                                       suggestion="call init_state() (or fit) first")
            self._train_step = self.steps.train_step(self._user_step, self.states.state_specs())
        if example_batch is not None:
            batch = self.inputs.placed(example_batch)
            self.steps.check_batch(batch)
            self._train_step.compiled_for(self.state, batch)
        return self._train_step

    def train_step(self, host_batch: Any) -> Dict[str, jax.Array]:
        """One step on a host batch; updates ``self.state``; returns the device metrics."""
        batch = self.inputs.placed(host_batch)
        self._local_batch_rows = (jax.tree_util.tree_leaves(batch)[0].shape[0]
                                  // self.plan.batch_shards(self.mesh))
        compiled = self.compile()
        if not compiled.compile_count:
            self.steps.check_batch(batch)
        self.state, metrics = compiled(self.state, batch)
        return metrics

    # --- Training ------------------------------------------------------------------------------

    def fit(self, step_fn: Optional[Callable] = None, data: Optional[Iterable] = None,
            steps: Optional[int] = None, eval_every: Optional[int] = None, *,
            params: Any = None, on_start: Optional[Callable[[], None]] = None) -> TrainState:
        """Trains for ``steps`` (default ``max_steps``) on ``data`` (default ``train_input``);
        ``on_start`` is called once the run really trains (the launcher's config record)."""
        self.build()
        if step_fn is not None:
            self._user_step, self._train_step = step_fn, None
        if data is not None and not self.objective.takes_user_data():
            raise errors.StepError(f"a {self.objective.name} run makes its batches by sampling "
                                   "its prompts", path="fit(data=...)",
                                   suggestion="leave data out: the run reads train_input")
        total = run_parts.steps_to_train(steps, max_steps=self.config.max_steps)
        if data is None:
            self.check_inputs()
        if self.state is None:
            self.init_or_restore(params=params)
        # Everything that can still fail comes first (the data source is opened here); only
        # then does the run leave traces: the checkpoint dir claimed (or the old run moved
        # aside), loggers started, the config record written.
        iterator = PlainBatches(iter(data)) if data is not None else self._configured_iterator()
        self.prepare_evaluation()
        if self._restored_data_state and hasattr(iterator, "set_state"):
            iterator.set_state(self._restored_data_state)
            self._restored_data_state = None
        preemption.exit_if_requested("before the first step")
        self._claim_checkpoint_dir()
        start = int(jax.device_get(self.state.step))
        self._start_loggers(start, total)
        if on_start is not None and start < total and jax.process_index() == 0:
            on_start()
        with preemption.preemption_guard(True) as guard:
            run_parts.training_loop(self, total).run(iterator, start=start, total=total,
                                                     eval_every=eval_every, guard=guard)
        return self.state

    def _configured_iterator(self):
        """The configured input as the objective trains on it: ``(host batch, host metrics)``
        pairs, one stream per engine, continued by later fit() calls."""
        if self._train_iterator is None:
            made = self.make_input(self.config.train_input, where="train_input")
            self._train_iterator = self.objective.batches(made, run=self)
        return self._train_iterator

    def first_train_batch(self) -> Any:
        """The first host batch a step trains on (a sampling objective's: its first rollout's
        rows, sampled with the current params)."""
        self.build()
        if not self.objective.takes_user_data():
            return next(self._configured_iterator())[0]
        made = self.make_input(self.config.train_input, where="train_input")
        return next(self.objective.batches(made, run=self))[0]

    def _start_loggers(self, step: int, total: int) -> None:
        if not self._loggers_started:
            goodput.CLOCK.begin_run(
                trainer_dir=self.trainer_dir if jax.process_index() == 0 else None,
                resumed=self._resumed)
            for logger in self.loggers():
                logger.start(step=step, total_steps=total, resumed=self._resumed)
            self._loggers_started = True

    def loggers(self) -> List[Logger]:
        if self._loggers is None:
            self._loggers = [cfg.instantiate(trainer_dir=self.trainer_dir,
                                             run_config=self.config)
                             for cfg in self.config.loggers] if jax.process_index() == 0 else []
            for logger in self._loggers:
                logger.console_columns = tuple(self.objective.console_columns)
        return self._loggers

    # --- Evaluation ----------------------------------------------------------------------------

    def prepare_evaluation(self) -> None:
        """The evalers' inputs built now: their cut and unscored rows reported at the start."""
        self.evaluation.prepare_inputs(self.make_input)

    def run_evalers(self, step: int, *, only_due: bool = True) -> Dict[str, Dict[str, float]]:
        return self.evaluation.run(
            step, evaluate=lambda data, batches: self.eval(data=data, steps=batches),
            make_input=self.make_input, loggers=self.loggers(), only_due=only_due, engine=self)

    def eval(self, step_fn: Optional[Callable] = None, data: Optional[Iterable] = None,
             steps: Optional[int] = None) -> Dict[str, float]:
        """Forward-only metrics over ``steps`` batches of ``data`` (all of it when steps=None)."""
        self.build()
        key = step_fn or "model"
        if key not in self._eval_steps:
            self._eval_steps[key] = self.steps.eval_step(step_fn)
        return evaluation_lib.evaluate(self._eval_steps[key], self.state.params, data,
                                       steps=steps, place=self.inputs.placed)

    # --- Reports -------------------------------------------------------------------------------

    def collectives(self) -> List[hlo.CollectiveOp]:
        """Every collective of the compiled train step (compile it first)."""
        if self._train_step is None or self._train_step.latest is None:
            raise errors.StepError("the train step is not compiled yet", path="engine",
                                   suggestion="call compile(example_batch=...) or train a step")
        return hlo.collectives_report(self._train_step.latest.as_text(), self.mesh)

    def explain(self) -> str:
        """Mesh, the layout of every param, the schedule, the state per device, and the
        compiled step's collectives."""
        return explain_lib.explain_engine(self.build())

    # --- Launcher entry point ------------------------------------------------------------------

    def run(self, *, trainer_dir: Optional[str] = None, cluster=None, explain: bool = False,
            compile_only: bool = False, on_start: Optional[Callable[[], None]] = None) -> int:
        """What ``python -m titanax.launch`` calls (``run_entry.run``): train, evaluate,
        report; with ``explain`` only compile the train step and print ``explain()``; with
        ``compile_only`` compile it from shapes and print its memory per device."""
        return run_entry.run(self, trainer_dir=trainer_dir, cluster=cluster, explain=explain,
                             compile_only=compile_only, on_start=on_start)

    def compiled_train_step(self) -> Optional[CompiledStep]:
        """The compiled train step (None before the first step)."""
        return self._train_step

    def close(self) -> None:
        """Waits for checkpoint writes and closes the checkpointer and loggers."""
        if self._checkpointer is not None:
            self._checkpointer.close()
        for logger in self._loggers or []:
            logger.close()

