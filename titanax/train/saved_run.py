"""A finished (or running) run's model, rebuilt from its directory onto this process's devices.

``python -m titanax.export`` and ``python -m titanax.generate`` act on a run directory: its
config record (``config.json``, written when the run started) says what the model is, its
checkpoints hold the params. The model is rebuilt on a mesh of the devices at hand -- not
necessarily the run's: checkpoints restore onto any mesh -- with the plan the command needs
(``mesh`` / ``plan`` below), and only the params are read (``restore_mode=params``).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from titanax import errors
from titanax.config import ConfigBase, config_for_function
from titanax.config.from_json import config_from_json
from titanax.io.files import read_json_object
from titanax.train import optimizers
from titanax.train.learner import Learner
from titanax.train.precision import Precision

RECORD = "config.json"


def read_run_config(trainer_dir: str) -> ConfigBase:
    """The config tree a run was started with."""
    path = os.path.join(trainer_dir, RECORD)
    if not os.path.isfile(path):
        raise errors.CheckpointError(
            "no run record here" if os.path.isdir(trainer_dir) else "no such run directory",
            path=path, suggestion="give the --trainer_dir of a run started by titanax.launch "
                                  "(it holds config.json and checkpoints/)")
    data = read_json_object(path, error=errors.CheckpointError,
                            suggestion="restore the file from the run's copy (config.txt holds "
                                       "the same tree)")
    retired: Dict[str, Any] = {}
    cfg = config_from_json(data, path="config", retired=retired)
    # Written before layers asked the axis binding: a model that split its residual stream
    # over the sequence said so itself; the plan says it now.
    if retired.get("config.model.sequence_parallel") and cfg.plan is not None \
            and cfg.plan.tensor_parallel is not None:
        cfg.plan.tensor_parallel.sequence_parallel = True
    return cfg


def stateless_learner() -> Learner.Config:
    """A learner with no optimizer state (plain SGD): commands that only read the params do not
    allocate Adam's two copies of them."""
    return Learner.default_config().set(  # (Its rate is never used: no step is taken.)
        optimizer=config_for_function(optimizers.sgd).set(learning_rate=1.0))


def precision_for(dtype: Optional[str]) -> Optional[Precision.Config]:
    """Params stored and computed in ``dtype`` ("float32" / "bfloat16"); None keeps the run's."""
    if dtype is None:
        return None
    return Precision.default_config().set(bfloat16=dtype == "bfloat16")


def restored_engine(trainer_dir: str, *, step: Optional[int] = None,
                    mesh: Optional[ConfigBase] = None, plan: Optional[ConfigBase] = None,
                    dtype: Optional[str] = None, run: Optional[ConfigBase] = None,
                    **model_changes):
    """The run's Engine with its params restored from the checkpoint at ``step`` (default: the
    newest) and no optimizer state; ``mesh`` / ``plan`` replace the run's (a model split for the
    command's needs), ``dtype`` its precision, ``model_changes`` set model fields that do not
    change its params; ``run``: the run's config, when the caller read it already."""
    cfg = (run or read_run_config(trainer_dir)).clone()
    recorded_text = cfg.debug_string()
    cfg.learner = stateless_learner()
    cfg.optimizer = None
    if dtype is not None:
        cfg.precision = precision_for(dtype)
    if cfg.model is None:
        raise errors.CheckpointError("the run has no model config", path=f"{trainer_dir}/{RECORD}",
                                     suggestion="export and generate act on runs of a model")
    if mesh is not None:
        cfg.mesh = mesh
    if plan is not None:
        cfg.plan = plan
    for name, value in model_changes.items():
        if name in type(cfg.model).__fields__:
            setattr(cfg.model, name, value)
    if cfg.checkpoint is None:
        raise errors.CheckpointError("the run wrote no checkpoints (checkpoint: None)",
                                     path=f"{trainer_dir}/{RECORD}",
                                     suggestion="train with checkpointing on")
    cfg.checkpoint.overwrite = False
    cfg.init_from = None  # The params come from the run's checkpoint.
    cfg.loggers = []
    cfg.evalers = {}
    cfg.train_input = None
    engine = cfg.instantiate(trainer_dir=trainer_dir).build()
    # Compared with the run's own record, not with the mesh and plan chosen here: a checkpoint
    # of another config is said so, this command's layout is not.
    restored = engine.states.restore(step=step, mode="params",
                                     config_text=recorded_text)
    if restored is None:
        raise errors.CheckpointError("the run has no checkpoint to read",
                                     path=engine.checkpointer().directory,
                                     suggestion="train the run first (a run saves at its end)")
    engine.state, engine.restored_from = restored.state, restored.path
    return engine


def source_dir(run: ConfigBase) -> Optional[str]:
    """The Hugging Face directory a run was fine-tuned from (its tokenizer, token ids and
    family), or None; a recorded directory that is gone is said so (the command goes on
    without it)."""
    source = getattr(run, "init_from", None)
    if source and not os.path.isdir(source):
        print(f"titanax: warning: the run was fine-tuned from {source}, which is gone: its "
              "tokenizer, token ids and model family are not carried over", flush=True)
        return None
    return source
