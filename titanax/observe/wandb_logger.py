"""``WandB``: the run config and step metrics in Weights & Biases (optional extra ``wandb``).

Why a file of its own: it is the one logger with a third-party service behind it, so it is the one
that needs a package many installs lack (``pip install 'titanax[wandb]'``; ``wandb`` is imported
only when the logger starts, and its absence is a ``ConfigError`` naming the logger, not an
ImportError traceback) and state that outlives the process: the W&B run id.

One run directory is one W&B run. The id is kept in ``<trainer_dir>/wandb_run_id``: a resumed run
(the engine restored a checkpoint) opens the same id with ``resume="allow"``, so the W&B run goes
on where it was; a new run in a directory that holds an id moves that file aside
(``wandb_run_id.<time>``, as ``CSV`` does with its table) and gets a new id, so two runs' metrics
are never mixed. The W&B step is the train step. A sampling objective's sample completions
(``observe/samples.py``) are logged as a table, ``samples``, at the step that trains on them. After a resume the steps between the checkpoint
and the point where the earlier process stopped are trained and logged again; W&B's steps only go
up (it ignores, with a warning, a step below its run's latest), so the W&B run keeps the values it
already had for them -- the same computation.

Offline (``mode="offline"`` or ``WANDB_MODE=offline``) the run is written under
``<dir>/wandb/offline-run-*`` and uploaded later with ``wandb sync``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, Literal, Optional, Tuple

from titanax import errors
from titanax.config import REQUIRED, ConfigBase, Required
from titanax.observe.loggers import Logger
from titanax.utils.files import atomic_write_text, unused_path

# The file in the trainer dir that keeps the W&B run id between launches.
RUN_ID_FILE = "wandb_run_id"

_INSTALL = "pip install 'titanax[wandb]'"


class WandB(Logger):
    """Weights & Biases: the run config once, then ``log_dict(metrics, step)`` at the train step."""

    class Config(Logger.Config):
        # W&B project the run is logged to.
        project: Required[str] = REQUIRED
        # W&B entity (user or team) owning the project; None: the account's default entity.
        entity: Optional[str] = None
        # Display name of the run; None: the trainer dir's base name (W&B picks one when the
        # logger has no trainer dir).
        name: Optional[str] = None
        # W&B group the run belongs to (e.g. the runs of one sweep); None: no group.
        group: Optional[str] = None
        # Tags shown with the run in the W&B UI.
        tags: Tuple[str, ...] = ()
        # "online": stream to the W&B server; "offline": write to `dir` only (upload later with
        # `wandb sync`); "disabled": log nothing (wandb is not even imported). None: what
        # WANDB_MODE says, else wandb's default (online).
        mode: Optional[Literal["online", "offline", "disabled"]] = None
        # Directory wandb writes its files under (it makes <dir>/wandb/); None: the trainer dir.
        dir: Optional[str] = None

    def __init__(self, cfg=None, *, trainer_dir=None, run_config=None, **fields):
        super().__init__(cfg, trainer_dir=trainer_dir, run_config=run_config, **fields)
        # Without a trainer dir there is nowhere to keep the id: every start is a new W&B run.
        self.id_path = os.path.join(trainer_dir, RUN_ID_FILE) if trainer_dir else None
        self._run: Any = None

    @property
    def run(self) -> Any:
        """The ``wandb`` Run this logger writes to (None before it starts and after close)."""
        return self._run

    def start(self, *, step: int, total_steps: Optional[int] = None, resumed: bool = False
              ) -> None:
        """Opens the W&B run: the recorded one again when ``resumed``, else a new one."""
        super().start(step=step, total_steps=total_steps, resumed=resumed)
        self._open(resumed=resumed)

    def _open(self, *, resumed: bool) -> None:
        cfg = self.config
        if self._run is not None or cfg.mode == "disabled":
            return
        wandb = _import_wandb()
        run_id = self._recorded_id()
        if run_id is not None and not resumed:
            # A new run: the earlier run's id is kept aside, never continued.
            stamp = time.strftime("%Y%m%dT%H%M%S")
            os.replace(self.id_path, unused_path(f"{self.id_path}.{stamp}"))
            run_id = None
        directory = cfg.dir or self.trainer_dir
        if directory:
            os.makedirs(directory, exist_ok=True)
        name = cfg.name
        if name is None and self.trainer_dir:
            name = os.path.basename(os.path.normpath(os.path.abspath(self.trainer_dir)))
        self._run = wandb.init(
            project=cfg.project, entity=cfg.entity, name=name, group=cfg.group,
            tags=list(cfg.tags) or None, mode=cfg.mode, dir=directory,
            config=_config_dict(self.run_config),
            id=run_id, resume="allow" if run_id is not None else None,
            # This logger's run is its own: never one a script opened (nor finished with it).
            reinit="create_new")
        if self.id_path is not None and self._run.id != run_id:
            atomic_write_text(self.id_path, f"{self._run.id}\n")

    def _recorded_id(self) -> Optional[str]:
        if self.id_path is None or not os.path.isfile(self.id_path):
            return None
        with open(self.id_path, encoding="utf-8") as f:
            return f.read().strip() or None

    def log_dict(self, metrics: Dict[str, float], step: int) -> None:
        if self._run is None:
            # Logged without start() (an evaluation outside fit): the directory's run goes on.
            self._open(resumed=True)
            if self._run is None:  # mode="disabled"
                return
        self._run.log(dict(metrics), step=step)

    def log_samples(self, rows, step: int) -> None:
        """The rows as a W&B table ``samples`` at ``step`` (columns: prompt, completion and,
        when rewarded, reward), beside the step's metrics."""
        if not rows:
            return
        if self._run is None:
            self._open(resumed=True)
            if self._run is None:  # mode="disabled"
                return
        import wandb  # pylint: disable=import-outside-toplevel  (imported by _open)
        columns = [c for c in ("prompt", "completion", "reward") if c in rows[0]]
        table = wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])
        self._run.log({"samples": table}, step=step)

    def close(self) -> None:
        """Finishes the W&B run (wandb's service completes the files just after this returns)."""
        if self._run is not None:
            self._run.finish()
            self._run = None


def _import_wandb():
    try:
        import wandb  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise errors.ConfigError(
            "the Weights & Biases logger needs the wandb package, which is not installed",
            path="loggers: WandB", suggestion=f"{_INSTALL}, or remove WandB from the loggers") from e
    return wandb


def _config_dict(run_config: Any) -> Optional[Dict[str, Any]]:
    """The run's config tree as the nested dict W&B shows (classes and functions as import
    paths, as in ``config.json``)."""
    if run_config is None:
        return None
    if isinstance(run_config, ConfigBase):
        return run_config.to_json()
    return dict(run_config)
