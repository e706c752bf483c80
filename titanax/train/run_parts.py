"""The parts of a run the Engine assembles without deciding anything: those that read its layout
(the state manager, the step builder), the training loop of a ``fit`` and the number of steps it
trains."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import jax
import numpy as np

from titanax import errors
from titanax.modules import converters as converters_lib
from titanax.train import learner as learner_lib
from titanax.train import param_layouts as param_layouts_lib
from titanax.train import state_sharding as state_sharding_lib
from titanax.train.metrics_window import MetricsWindow
from titanax.train.state_manager import StateManager
from titanax.train.step_builder import StepBuilder
from titanax.train.training_loop import TrainingLoop


def state_and_steps(engine: Any, parameter_specs: Any) -> Tuple[StateManager, StepBuilder]:
    """The state manager and step builder over ``engine.layout`` (just set from
    ``parameter_specs``), their optimizer seeing the trainable params only."""
    layout, cfg = engine.layout, engine.config
    strategy = state_sharding_lib.for_layout(layout, zero=engine.plan.config.zero)
    # (The optimizer sees the trainable params only: train/trainable.py.)
    trained_specs = (strategy.trainable.select(layout.parameter_specs)
                     if engine.model is not None else None)
    decay = (learner_lib.decay_scales_from_specs(trained_specs)
             if trained_specs is not None else None)
    layouts = (param_layouts_lib.param_layouts(parameter_specs=trained_specs,
                                               update_specs=strategy.update_specs,
                                               mesh_shape=dict(engine.mesh.shape),
                                               stack_view=layout.stack_view)
               if trained_specs is not None else None)
    adapter = (learner_lib.OptimizerAdapter(cfg.optimizer) if cfg.optimizer is not None
               else engine.learner.build(decay, param_layouts=layouts,
                                         device_count=engine.mesh.size))
    states = StateManager(mesh=engine.mesh, layout=layout, strategy=strategy, adapter=adapter,
                          precision=engine.precision, model=engine.model, seed=cfg.seed,
                          checkpointer=engine.checkpointer(),
                          model_specs=parameter_specs if engine.model is not None else None,
                          frozen_dtype=converters_lib.frozen_dtype(engine.converters),
                          batch_axes=engine.plan.batch_axes)
    steps = StepBuilder(mesh=engine.mesh, plan=engine.plan, layout=layout, strategy=strategy,
                        model=engine.model, precision=engine.precision, adapter=adapter,
                        learner=engine.learner, nan_policy=cfg.nan_policy,
                        recompile_policy=cfg.recompile_policy, converters=engine.converters,
                        objective=engine.objective)
    return states, steps


def steps_to_train(steps: Optional[int], *, max_steps: Optional[int]) -> int:
    """The step a ``fit`` trains up to: ``steps``, else the config's ``max_steps``."""
    total = steps if steps is not None else max_steps
    if total is None:
        raise errors.StepError("how many steps?", path="engine.max_steps",
                               suggestion="set max_steps or pass steps= to fit()")
    if isinstance(total, bool) or not isinstance(total, (int, np.integer)) or total < 0:
        raise errors.StepError(f"the number of steps must be an int >= 0, got {total!r}",
                               path="fit(steps=...)" if steps is not None else "max_steps",
                               suggestion="pass the step to train up to, e.g. steps=1000")
    return int(total)


def training_loop(engine: Any, total: int) -> TrainingLoop:
    """The loop of one ``fit`` up to step ``total``, wired to the engine's step, state,
    evaluations, checkpoints, loggers and profiler."""
    cfg = engine.config
    window = MetricsWindow(
        loggers=engine.loggers(), total=total, nan_policy=cfg.nan_policy, history=engine.history,
        compiled=engine.compiled_train_step,
        schedule_metrics=lambda: (engine.steps.schedule_metrics(engine._local_batch_rows)  # pylint: disable=protected-access
                                  if engine._local_batch_rows else {}))  # pylint: disable=protected-access
    limit = cfg.max_inflight_steps
    if limit is None and engine.mesh.devices.flat[0].platform == "cpu":
        limit = 1
    return TrainingLoop(
        train_step=engine.train_step, current_step=lambda: int(jax.device_get(engine.state.step)),
        hooks=engine.hooks, window=window, log_every=cfg.log_every, inflight_limit=limit,
        evals_due=engine.evaluation.due,
        run_evals=lambda step, only_due: engine.run_evalers(step, only_due=only_due),
        checkpointer=engine.checkpointer(), save=lambda it: engine.save(data_iterator=it),
        save_local=lambda it: engine.save(data_iterator=it, local=True),
        save_on_preemption=cfg.save_on_preemption,
        profiler=(cfg.profile.instantiate(trainer_dir=engine.trainer_dir)
                  if cfg.profile is not None else None))
