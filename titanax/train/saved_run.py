"""A finished (or running) run's model, rebuilt from its directory onto this process's devices.

``python -m titanax.export`` and ``python -m titanax.generate`` act on a run directory: its
config record (``config.json``, written when the run started) says what the model is, its
checkpoints hold the params. The model is rebuilt on a mesh of the devices at hand -- not
necessarily the run's: checkpoints restore onto any mesh -- with the plan the command needs
(``mesh`` / ``plan`` below), and only the params are read (``restore_mode=params``).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

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


def _hf_tokenizer(directory: str):
    """The HF directory's tokenizer (tokenizer.json, else tokenizer.model), or None."""
    from titanax.data.tokenizer import SENTENCEPIECE_FILE, TOKENIZER_FILE, Tokenizer  # pylint: disable=import-outside-toplevel
    if any(os.path.isfile(os.path.join(directory, name))
           for name in (TOKENIZER_FILE, SENTENCEPIECE_FILE)):
        return Tokenizer.default_config().set(path=directory)
    return None


def _run_tokenizer(run) -> Optional[Any]:
    """The tokenizer a run was trained with: its train input's (bytes when unset), or -- for
    a run without a configured input -- its HF source's."""
    train_input = getattr(run, "train_input", None)
    if train_input is not None and getattr(train_input, "tokenizer", None) is not None:
        return train_input.tokenizer if train_input.tokenizer.path is not None else None
    source = getattr(run, "init_from", None)
    return _hf_tokenizer(source) if source and os.path.isdir(source) else None


def inference_engine(*, hf: Optional[str], trainer_dir: Optional[str], model_parallel: int = 1,
                     dtype: Optional[str] = None, step: Optional[int] = None):
    """``(engine, HF source dir or None, tokenizer config or None)``: the model of the HF
    directory ``hf`` (data x ``model_parallel``) or of the run in ``trainer_dir`` (its newest
    checkpoint, or ``step``; its own data x TP mesh) on this process's devices, for inference
    (titanax.generate, titanax.evaluate)."""
    from titanax.parallel.plan import DP, TP, Plan  # pylint: disable=import-outside-toplevel
    from titanax.runtime.mesh import MeshSpec  # pylint: disable=import-outside-toplevel
    if hf:
        from titanax.hf import importer  # pylint: disable=import-outside-toplevel
        from titanax.train.engine import Engine  # pylint: disable=import-outside-toplevel
        hf = os.path.abspath(hf)
        tp = model_parallel
        import jax  # pylint: disable=import-outside-toplevel
        devices = jax.device_count()
        if devices % tp:
            raise errors.LaunchFlagError(
                f"{tp}-way tensor parallelism does not divide the {devices} device(s) at hand",
                path="--model_parallel",
                suggestion=f"give a divisor of {devices} (e.g. --model_parallel="
                           f"{max(d for d in range(1, min(tp, devices) + 1) if devices % d == 0)})")
        cfg = Engine.default_config().set(
            mesh=MeshSpec.default_config().set(axes=("data", "model"), shape=(None, tp)),
            plan=Plan.default_config().set(data_parallel=DP.default_config(),
                                           tensor_parallel=TP.default_config() if tp > 1
                                           else None),
            model=importer.model_config(hf), init_from=hf,
            learner=stateless_learner(), loggers=[])
        if dtype is not None:
            cfg.precision = precision_for(dtype)
        engine = cfg.instantiate()
        engine.init_or_restore()
        return engine, hf, _hf_tokenizer(hf)
    trainer_dir = os.path.abspath(trainer_dir)
    run = read_run_config(trainer_dir)
    if getattr(run.model, "moe", None) is not None:
        # Every expert is local (below): each token goes through all its experts, none dropped
        # however the prompt's tokens are routed (the capacity of training would drop some).
        run = run.clone()
        run.model.moe.dispatch = "dropless"
    # Generation runs rows on data x model: the pipe, context and expert axes join data (each
    # device then holds every expert).
    plan = run.plan.clone(pipeline_parallel=None, zero=None, context_parallel=None,
                          expert_parallel=None)
    engine = restored_engine(trainer_dir, step=step, run=run,
                             mesh=_data_and_model_only(run.mesh, plan), plan=plan, dtype=dtype)
    return engine, source_dir(run), _run_tokenizer(run)


def _data_and_model_only(mesh, plan):
    """The run's mesh with only the axes generation uses (data, and the TP axis): the devices
    of the others (pipe, an HSDP fsdp axis) join data -- checkpoints restore onto any mesh."""
    roles = {plan.data_parallel.axis} | ({plan.tensor_parallel.axis}
                                         if plan.tensor_parallel is not None else set())
    shape = tuple(mesh.shape) if mesh.shape is not None else (None,) * len(mesh.axes)
    keep = [i for i, axis in enumerate(mesh.axes) if axis in roles]
    return mesh.clone(axes=tuple(mesh.axes[i] for i in keep),
                      shape=tuple(None if mesh.axes[i] == plan.data_parallel.axis else shape[i]
                                  for i in keep))


def generation_end_ids(source_dir: Optional[str]) -> List[int]:
    """The ids transformers' generate stops at for the HF directory: its
    generation_config.json's ``eos_token_id`` (else config.json's); [] without one."""
    import json  # pylint: disable=import-outside-toplevel
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(source_dir, name) if source_dir else ""
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                end = json.load(f).get("eos_token_id")
            if end is not None:
                return [end] if isinstance(end, int) else list(end)
    return []
