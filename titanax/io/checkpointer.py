"""Checkpoints on Orbax: async saves, retention, atomic commits, metadata, restore onto any mesh.

Each saved step is a directory with four Orbax items:

* ``params`` -- the model params (so plain Orbax, or a fine-tuning job, can read them alone);
* ``train_state`` -- optimizer state, step counter, PRNG streams, loss scale;
* ``data`` -- the input iterator's state, so a resumed run reads exactly the batches it would have;
* ``metadata`` -- mesh axes and shape, every param's PartitionSpec, dtypes, an optimizer-config
  hash, Titanax / JAX / Orbax versions and the run's config ``debug_string()``.

Orbax writes each step into a temporary directory and renames it when complete, so a crash or a
SIGKILL mid-save leaves nothing that looks like a checkpoint. Restoring reads arrays straight into
the shardings of the *current* mesh and plan (so a run saved on data=4 x model=2 resumes on 2 x 4,
8 x 1 or one device); a structure, shape or dtype mismatch fails with a ``path: shape dtype``
diff; a newest checkpoint that cannot be read is reported by name, moved aside (kept) and the next
one is used.

Nothing is lost or mixed up silently: a save Orbax would skip is an error, never a no-op; a step
counts as saved only after ``wait_until_finished()`` saw it committed; a fresh run refuses a
directory holding another run's checkpoints (or, asked to, moves them aside).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from typing import Any, Callable, Dict, List, Literal, Mapping, Optional, Protocol, Tuple

import jax
import numpy as np

from titanax import errors
from titanax.config import Configurable
from titanax.io import local_tier, path_renames
from titanax.utils.files import unused_path

_log = logging.getLogger("titanax")


def _write_replicated_arrays_from_one_replica_per_host() -> None:
    """Orbax's replica-parallel writing off, unless the job spans several processes.

    With it (Orbax's default off GPUs), each of an array's R replicas writes 1/R of it: on
    several hosts that splits the bytes each host writes. In one process every replica's part is
    written by the same host anyway, and cutting it costs an eager slice per replica and array --
    each its own compiled program (per shape, offset and device: measured, 268 of them in one
    test file, and a fifth of a 6-step tiny run's time in its final save). Process-wide: Orbax
    picks its array handler from a global registry, and the process count never changes."""
    if jax.process_count() > 1:
        return
    from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel
    from orbax.checkpoint import type_handlers  # pylint: disable=import-outside-toplevel
    current = type_handlers.get_type_handler(jax.Array)
    if isinstance(current, type_handlers.ArrayHandler) and \
            not getattr(current, "_use_replica_parallel", True):
        return  # (Registered already.)
    # (Orbax logs a warning for every override, on the console the user reads: not news here.)
    absl_logger = absl_logging.get_absl_logger()
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        type_handlers.register_type_handler(
            jax.Array, type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
    finally:
        absl_logger.setLevel(level)


class CheckpointStrategy(Protocol):
    """What the engine needs from a checkpointer (the seed's interface)."""

    def save(self, state: Any, step: int) -> bool: ...

    def load(self, step: Optional[int] = None) -> Any: ...

    def latest_step(self) -> Optional[int]: ...


@dataclasses.dataclass
class Restored:
    """What ``restore`` found."""

    step: int
    params: Any
    train_state: Optional[Dict[str, Any]]
    data_state: Optional[Dict[str, Any]]
    metadata: Dict[str, Any]
    path: str


def config_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class OrbaxCheckpoint(Configurable):
    """Saves and restores train states with Orbax's CheckpointManager."""

    class Config(Configurable.Config):
        # Directory of the checkpoints; None: <trainer_dir>/checkpoints. Made absolute.
        path: Optional[str] = None
        # Save every this many steps (0: only at the end and on demand).
        save_every_n_steps: int = 1000
        # Save the last step when training ends.
        save_at_end: bool = True
        # Keep the newest N checkpoints (None: keep all).
        keep_last_n: Optional[int] = 3
        # Also keep every checkpoint whose step is a multiple of this (None: none extra).
        keep_every_n_steps: Optional[int] = None
        # Write in the background while training goes on.
        async_save: bool = True
        # At start, "auto" resumes from the newest good checkpoint; "never" starts fresh.
        resume: Literal["auto", "never"] = "auto"
        # What a restore loads: "full" (params, optimizer, step, data position) or "params"
        # (params only: fine-tuning or evaluation; the rest starts fresh).
        restore_mode: Literal["full", "params"] = "full"
        # A fresh run (resume="never", or init_state() by hand) whose directory already holds
        # checkpoints of another run: False refuses before training (the old steps would be
        # mixed with the new run's); True moves the whole directory aside to
        # "<path>.superseded-<time>" (kept, never deleted) and starts with an empty one.
        overwrite: bool = False
        # The local tier (io/local_tier.py): every local_every_n_steps steps each process
        # writes its shards and a copy of its peer's under this directory on its own disk; a
        # restart takes the newest complete step of either tier. None: persistent tier only.
        local_dir: Optional[str] = None
        # Steps between local saves (needs local_dir).
        local_every_n_steps: Optional[int] = None

        def _validate_values(self):
            if self.local_dir is not None and not str(self.local_dir).strip():
                yield "local_dir", "is empty: name a directory on each host's local disk"
            if self.local_every_n_steps is not None and self.local_every_n_steps < 1:
                yield "local_every_n_steps", f"must be >= 1, got {self.local_every_n_steps}"
            if (self.local_dir is None) != (self.local_every_n_steps is None):
                given = "local_dir" if self.local_dir is not None else "local_every_n_steps"
                yield given, ("the local tier needs both local_dir and local_every_n_steps; "
                              f"only {given} is set")
            if self.save_every_n_steps < 0:
                yield "save_every_n_steps", "must be >= 0"
            if self.keep_last_n is not None and self.keep_last_n < 1:
                yield "keep_last_n", "must be >= 1 (or None to keep all)"
            if self.keep_every_n_steps is not None and self.keep_every_n_steps < 1:
                yield "keep_every_n_steps", (f"must be >= 1 (or None: keep only the last "
                                             f"keep_last_n), got {self.keep_every_n_steps}")

    def __init__(self, cfg=None, *, trainer_dir: Optional[str] = None, **fields):
        """``OrbaxCheckpoint("ckpts/run1")`` (the seed's form) sets the path."""
        if isinstance(cfg, (str, os.PathLike)):
            cfg, fields = None, {**fields, "path": os.fspath(cfg)}
        super().__init__(cfg, **fields)
        path = self.config.path or os.path.join(trainer_dir or ".", "checkpoints")
        # A remote URL (gs://, s3://...) is kept as given; a local path made absolute.
        self.directory = path if is_url(path) else os.path.abspath(path)
        self._manager = None
        # Steps this run saved or restored: saving one of them again is a harmless no-op, while
        # an existing step of any other origin is another run's and must never be taken as ours.
        self._own_steps: set = set()
        # Saves started and not yet verified as committed.
        self._pending: List[int] = []
        cfg = self.config
        self.local: Optional[local_tier.LocalTier] = (
            local_tier.LocalTier(local_dir=cfg.local_dir, every_n_steps=cfg.local_every_n_steps,
                                 run=self.directory)
            if cfg.local_dir is not None and cfg.local_every_n_steps is not None else None)

    # --- The Orbax manager -----------------------------------------------------------------------

    @property
    def manager(self):
        if self._manager is None:
            import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
            cfg = self.config
            options = ocp.CheckpointManagerOptions(
                max_to_keep=cfg.keep_last_n, keep_period=cfg.keep_every_n_steps,
                enable_async_checkpointing=cfg.async_save, create=True,
                cleanup_tmp_directories=True,
                # A step's directories are made before save() returns: made in the background,
                # a save that fails leaves Orbax's threads waiting for them, and the
                # interpreter waits for those threads at exit (20 minutes, their timeout).
                async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
            _write_replicated_arrays_from_one_replica_per_host()
            # Handlers named up front, so a fresh manager can read item metadata before it has
            # saved or restored anything.
            handlers = {"params": ocp.StandardCheckpointHandler(),
                        "train_state": ocp.StandardCheckpointHandler(),
                        "data": ocp.JsonCheckpointHandler(),
                        "metadata": ocp.JsonCheckpointHandler()}
            self._manager = ocp.CheckpointManager(self.directory, options=options,
                                                  item_handlers=handlers)
            # Titanax agrees on preemption itself (train/preemption.py: jax's sync point, counted
            # in calls since the job started) and forces that save. Orbax would also ask jax's
            # sync point, with the global step, on every save: two counters in one sync manager
            # (a call that lands on the agreed point first takes it from the other).
            self._manager.reached_preemption = lambda step: False
        return self._manager

    def should_save(self, step: int) -> bool:
        every = self.config.save_every_n_steps
        return bool(every) and step % every == 0

    def should_save_local(self, step: int) -> bool:
        return self.local is not None and self.local.should_save(step)

    def save_local(self, state: Any, step: int, *, data_state: Optional[Dict] = None,
                   metadata: Optional[Dict] = None) -> None:
        """Starts a local-tier save of ``state`` as ``step`` (io/local_tier.py)."""
        self.local.save({"params": state.params, "train_state": train_state_tree(state)},
                        step=step, data_state=data_state or {}, metadata=metadata or {})

    # --- Saving ----------------------------------------------------------------------------------

    def save(self, state: Any, step: int, *, data_state: Optional[Dict] = None,
             metadata: Optional[Dict] = None, force: bool = False) -> bool:
        """Starts saving ``state`` (a TrainState) as ``step``.

        Returns False only when this run already saved (or restored) ``step``: nothing to do.
        Raises CheckpointError when Orbax would not write it -- a step of another run in the
        directory, or a newer step ahead of it -- since a save that silently does nothing loses
        the run. With ``async_save`` the arrays are copied off the device before this returns
        and written in the background; ``wait_until_finished()`` verifies the commit.
        """
        import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
        existing = self.manager.all_steps()
        if step in existing:
            if step in self._own_steps:
                return False
            raise errors.CheckpointError(
                f"step {step} already exists here and was not written by this run",
                path=str(_path(self.directory, str(step))),
                suggestion="use another --trainer_dir (or checkpoint.path), or restart with "
                           "checkpoint.overwrite=true to move the old checkpoints aside")
        newer = [s for s in existing if s > step]
        if newer:
            raise errors.CheckpointError(
                f"cannot save step {step}: the directory holds newer step(s) {newer}, so Orbax "
                "would refuse it", path=self.directory,
                suggestion="resume from the newest step, or use another --trainer_dir")
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(state.params),
            train_state=ocp.args.StandardSave(train_state_tree(state)),
            data=ocp.args.JsonSave(data_state or {}),
            metadata=ocp.args.JsonSave(metadata or {}))
        try:
            started = self.manager.save(step, args=args, force=force)
        except Exception as e:  # pylint: disable=broad-except
            raise errors.CheckpointError(
                f"saving step {step} failed: {type(e).__name__}: {e}", path=self.directory,
                suggestion="check the disk (space, permissions) and the path") from e
        if not started:
            raise errors.CheckpointError(
                f"Orbax declined to save step {step} (latest step there: "
                f"{self.manager.latest_step()})", path=self.directory,
                suggestion="use another --trainer_dir, or checkpoint.overwrite=true")
        self._own_steps.add(step)
        self._pending.append(step)
        return True

    def wait_until_finished(self) -> List[int]:
        """Waits for the saves in flight and verifies each was committed; returns their steps.

        Raises CheckpointError naming the step when a save failed or left no committed
        directory: "saved step N" may be said only after this returned.
        """
        if self.local is not None:
            self.local.wait()
        if self._manager is None:
            return []
        try:
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except Exception as e:  # pylint: disable=broad-except
            raise errors.CheckpointError(
                f"a checkpoint save failed in the background: {type(e).__name__}: {e}",
                path=self.directory, suggestion="check the disk (space, permissions)") from e
        pending, self._pending = self._pending, []
        if pending:
            self._manager.reload()
            committed = set(self._manager.all_steps())
            newest = max(committed, default=None)
            for step in pending:
                if step in committed and _path(self.directory, str(step)).is_dir():
                    continue
                # Retention (keep_last_n) may already have removed an older step it superseded.
                if step not in committed and newest is not None and newest > step and \
                        newest in pending:
                    continue
                raise errors.CheckpointError(
                    f"step {step} was saved but is not in the directory afterwards",
                    path=str(_path(self.directory, str(step))),
                    suggestion="check the disk and whether another process writes here")
        return pending

    def close(self) -> None:
        """Waits for the saves in flight (verified), then for Orbax's own background work, and
        closes the manager: no Orbax thread outlives it."""
        if self.local is not None:
            self.local.wait()
        if self._manager is not None:
            self.wait_until_finished()
            # The manager removes unfinished temporary step directories in a thread it starts on
            # construction and waits for only in save(); a manager closed without a save (a
            # refused fresh start, a restore-only use) left that thread racing the interpreter's
            # shutdown, which printed its traceback under a refused launch's clean message.
            manager, self._manager = self._manager, None
            try:
                await_orbax_cleanup(manager)
            finally:
                manager.close()

    def prepare_fresh_start(self) -> None:
        """Called before a run that did not resume starts training.

        A directory holding checkpoints belongs to another run: refuse (naming the two ways
        out), or with ``overwrite`` move the whole directory aside -- kept, not deleted.
        """
        steps = self.all_steps()
        if self.local is not None:
            self.local.set_aside()
        # Every process has looked before process 0 may move the directory (below).
        _barrier("titanax-fresh-start-looked")
        if not steps:
            return
        if not self.config.overwrite:
            resume = ("resume it (checkpoint.resume='auto'), " if self.config.resume != "auto"
                      else "")
            # Orbax's background threads stop before the process exits on this error (left
            # running, one raced the interpreter's shutdown and printed a traceback).
            self.close()
            raise errors.CheckpointError(
                f"this run starts fresh, but the directory holds checkpoints of another run "
                f"(steps {steps}); saving into it would mix the two runs", path=self.directory,
                suggestion=f"{resume}use another --trainer_dir, or pass "
                           "--config.checkpoint.overwrite=true to move the old checkpoints "
                           "aside (they are kept)")
        self.close()
        aside = unused_path(f"{self.directory}.superseded-{_timestamp()}")
        _on_process_zero(lambda: _path(self.directory).rename(aside), "titanax-fresh-start")
        print(f"titanax: moved the previous run's checkpoints (steps {steps}) aside to {aside}",
              flush=True)

    def move_aside(self, step: int, reason: str) -> str:
        """Renames a damaged step directory to ``<step>.damaged-<time>`` (kept for inspection),
        so it no longer blocks later saves; returns the new path."""
        where = str(_path(self.directory, str(step)))
        aside = unused_path(f"{where}.damaged-{_timestamp()}")
        _on_process_zero(lambda: _path(where).rename(aside), f"titanax-move-aside-{step}")
        if self._manager is not None:
            self._manager.reload()
        print(f"titanax: checkpoint step {step} is damaged ({reason}); moved it aside to {aside}",
              flush=True)
        return aside

    # --- Finding and restoring -------------------------------------------------------------------

    def all_steps(self) -> List[int]:
        """Complete checkpoints, oldest first (temporary, half-written directories excluded)."""
        if not _path(self.directory).is_dir():
            return []
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def latest_step(self) -> Optional[int]:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def read_metadata(self, step: int) -> Dict[str, Any]:
        import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
        restored = self.manager.restore(step, args=ocp.args.Composite(
            metadata=ocp.args.JsonRestore()))
        return dict(restored["metadata"] or {})

    def restore(self, *, params_target: Any, train_state_target: Any = None,
                step: Optional[int] = None, mode: Optional[str] = None,
                check_metadata: Optional[Callable[[Dict[str, Any], str], None]] = None,
                renames: Optional[Mapping[str, str]] = None) -> Optional[Restored]:
        """The newest readable checkpoint (or ``step``), read into the targets' shardings.

        ``params_target`` / ``train_state_target`` are trees of ``jax.ShapeDtypeStruct`` with
        shardings on the current mesh. Returns None when there is no checkpoint. A checkpoint that
        fails to read is reported by name and moved aside (``<step>.damaged-<time>``, kept), so
        it cannot block later saves, and the next older one is tried (unless ``step`` was asked
        for explicitly). ``check_metadata(metadata, where)`` may refuse a full restore (raise
        CheckpointError) before any array is read. ``renames`` (``{old path: new path}``,
        io/path_renames.py): a checkpoint that holds the old param names is read under them and
        handed back under the new ones, said on stdout.
        """
        mode = mode or self.config.restore_mode
        if self.local is not None and step is None and mode == "full":
            local = self._restore_local(params_target, train_state_target, check_metadata)
            if local is not None:
                return local
        candidates = [step] if step is not None else list(reversed(self.all_steps()))
        failed: List[Tuple[int, str]] = []
        for candidate in candidates:
            try:
                restored = self._restore_step(candidate, params_target, train_state_target, mode,
                                              check_metadata, renames or {})
            except errors.CheckpointError:
                raise
            except Exception as e:  # pylint: disable=broad-except
                where = str(_path(self.directory, str(candidate)))
                if jax.process_count() > 1 and step is None:
                    # Skipping it is a decision the processes would take apart (one read
                    # error, or a peer lost mid-read): never restore different steps.
                    raise errors.CheckpointError(
                        f"process {jax.process_index()} cannot read checkpoint step "
                        f"{candidate}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                        path=where, suggestion="if the step is damaged, move it aside (e.g. "
                        f"mv {where} {where}.damaged) and start the job again: it resumes from "
                        "the step before") from e
                if step is not None:
                    raise errors.CheckpointError(
                        f"cannot read checkpoint step {candidate}: {type(e).__name__}: {e}",
                        path=where, suggestion="pick another step, or move the damaged one away"
                    ) from e
                reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                _log.warning("skipping damaged checkpoint %s (%s); trying an older one",
                             where, reason)
                failed.append((candidate, reason))
                continue
            # An older step restored: the newer ones that failed would block this run's saves;
            # move them aside (kept for inspection).
            for newer, reason in failed:
                self.move_aside(newer, reason)
            self._own_steps.add(restored.step)
            return restored
        if failed:  # Never start over silently when checkpoints exist but none could be read.
            self._none_readable(failed)
        return None

    def _none_readable(self, failed: List[Tuple[int, str]]) -> None:
        listing = "; ".join(f"step {s}: {r}" for s, r in failed)
        self.close()
        raise errors.CheckpointError(
            f"no checkpoint here could be read ({listing})", path=self.directory,
            suggestion="check the disk and retry; if they are damaged, move them away, or "
                       "start a new run with --config.checkpoint.resume=never "
                       "--config.checkpoint.overwrite=true (moves them aside, kept)")

    def _restore_local(self, params_target, train_state_target, check_metadata
                       ) -> Optional[Restored]:
        """The local tier's newest step every process can rebuild, when it is newer than the
        persistent tier's and was saved on this layout (processes and mesh); else None."""
        step = self.local.newest_restorable()
        persistent = self.latest_step()
        if step is None or persistent is not None and persistent >= step:
            return None
        where = os.path.join(self.local.directory(self.local.process), str(step))
        extra, shards = self.local.read(step)
        metadata = extra.get("metadata") or {}
        mesh = jax.tree_util.tree_leaves(params_target)[0].sharding.mesh
        if (metadata.get("mesh_shape"), metadata.get("process_count")) != (
                [int(s) for s in mesh.devices.shape], jax.process_count()):
            if jax.process_index() == 0:
                print(f"titanax: the local tier's step {step} was saved on another layout; "
                      "restoring from the persistent tier", flush=True)
            return None
        if check_metadata is not None:
            check_metadata(metadata, where)
        tree = self.local.place(shards, {"params": params_target,
                                         "train_state": train_state_target})
        self._own_steps.add(step)
        return Restored(step=step, params=tree["params"], train_state=tree["train_state"],
                        data_state=extra.get("data_state") or None, metadata=metadata,
                        path=f"{where} (local tier)")

    def _restore_step(self, step: int, params_target, train_state_target, mode,
                      check_metadata, renames: Mapping[str, str]) -> Restored:
        import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
        where = str(_path(self.directory, str(step)))
        metadata = self.read_metadata(step)
        saved = self.manager.item_metadata(step)
        older = path_renames.reversed_renames(renames)
        renamed_names = bool(renames) and set(_flatten_metadata(saved["params"])) == set(
            _flatten_metadata(path_renames.renamed(params_target, older))) != set(
                _flatten_metadata(params_target))
        if renamed_names:  # Written under older param names: read under them.
            params_target = path_renames.renamed(params_target, older)
            if train_state_target is not None:
                train_state_target = path_renames.renamed(train_state_target, older)
            if jax.process_index() == 0:
                print(f"titanax: {where} holds params under older names; read as "
                      + ", ".join(f"{old} -> {new}" for old, new in renames.items()), flush=True)
        _check_matches(saved["params"], params_target, where=f"{where}/params")
        items = {"params": ocp.args.StandardRestore(params_target)}
        if mode == "full":
            if check_metadata is not None:
                check_metadata(metadata, where)
            _check_matches(saved["train_state"], train_state_target,
                           where=f"{where}/train_state")
            items["train_state"] = ocp.args.StandardRestore(train_state_target)
            items["data"] = ocp.args.JsonRestore()
        restored = dict(self.manager.restore(step, args=ocp.args.Composite(**items)))
        if renamed_names:
            for item in ("params", "train_state"):
                if restored.get(item) is not None:
                    restored[item] = path_renames.renamed(restored[item], renames)
        return Restored(step=step, params=restored["params"],
                        train_state=restored["train_state"] if mode == "full" else None,
                        data_state=(restored["data"] or None) if mode == "full" else None,
                        metadata=metadata, path=where)

    # --- The seed's interface --------------------------------------------------------------------

    def load(self, step: Optional[int] = None) -> Any:
        """Params of ``step`` (default: newest) as numpy arrays, on the host."""
        import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
        step = self.latest_step() if step is None else step
        if step is None:
            raise errors.CheckpointError("there is no checkpoint", path=self.directory,
                                         suggestion="train first, or check the path")
        saved = self.manager.item_metadata(step)["params"]
        target = jax.tree_util.tree_map(
            lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype,
                                           sharding=jax.sharding.SingleDeviceSharding(
                                               jax.local_devices()[0])), saved)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(target)))
        return jax.tree_util.tree_map(np.asarray, restored["params"])


def _timestamp() -> str:
    return time.strftime("%Y%m%dT%H%M%S")


def train_state_tree(state: Any) -> Dict[str, Any]:
    """The ``train_state`` item of a TrainState (of arrays, or of ShapeDtypeStructs as a target)."""
    tree = {"opt_state": state.opt_state, "step": state.step, "rngs": state.rngs}
    if state.loss_scale is not None:
        tree["loss_scale"] = state.loss_scale
    return tree


def _flatten_metadata(tree: Any) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
    out = {}
    for path, leaf in leaves:
        if hasattr(leaf, "shape"):
            out[_path_text(path)] = (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
    return out


def _path_text(path) -> str:
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def _check_matches(saved: Any, target: Any, *, where: str) -> None:
    """Raises CheckpointError with a ``path: shape dtype`` diff when the trees disagree."""
    have = _flatten_metadata(saved)
    want = _flatten_metadata(target)
    lines = []
    for path in sorted(set(have) | set(want)):
        if path not in want:
            lines.append(f"  {path}: in the checkpoint {_fmt(have[path])}, not in this run")
        elif path not in have:
            lines.append(f"  {path}: expected {_fmt(want[path])}, missing from the checkpoint")
        elif have[path] != want[path]:
            lines.append(f"  {path}: checkpoint {_fmt(have[path])} != this run {_fmt(want[path])}")
    if lines:
        shown = lines[:20] + ([f"  ... and {len(lines) - 20} more"] if len(lines) > 20 else [])
        raise errors.CheckpointError(
            f"the checkpoint does not match this run ({len(lines)} difference(s)):\n"
            + "\n".join(shown), path=where,
            suggestion="use the model and optimizer the checkpoint was saved with, or restore "
                       "params only (checkpoint.restore_mode='params')")


def _fmt(shape_dtype: Tuple[Tuple[int, ...], str]) -> str:
    shape, dtype = shape_dtype
    return f"{shape} {dtype}"


def run_metadata(*, mesh, param_specs: Any, params: Any, optimizer_text: str, config_text: str,
                 process_count: int) -> Dict[str, Any]:
    """The ``metadata`` item: enough to understand a checkpoint without the code that wrote it."""
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    import titanax  # pylint: disable=import-outside-toplevel
    from titanax.parallel.sharding import flat_paths  # pylint: disable=import-outside-toplevel
    from jax.sharding import PartitionSpec  # pylint: disable=import-outside-toplevel
    specs = flat_paths(param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    arrays = flat_paths(params)
    return {
        "mesh_axes": list(mesh.axis_names),
        "mesh_shape": [int(s) for s in mesh.devices.shape],
        "process_count": process_count,
        "params": {path: {"spec": [list(e) if isinstance(e, tuple) else e for e in spec],
                          "shape": list(arrays[path].shape),
                          "dtype": str(np.dtype(arrays[path].dtype))}
                   for path, spec in specs.items()},
        "optimizer_config_hash": config_hash(optimizer_text),
        "versions": {"titanax": titanax.__version__, "jax": jax.__version__,
                     "orbax": getattr(ocp, "__version__", "unknown")},
        "config": config_text,
    }


def is_url(path: str) -> bool:
    """Whether ``path`` names a remote location (``gs://bucket/run``), not a local file."""
    return "://" in str(path)


def _path(*parts: str):
    """An ``etils.epath`` path (local or remote alike)."""
    from etils import epath  # pylint: disable=import-outside-toplevel
    return epath.Path(parts[0]).joinpath(*parts[1:])


def _on_process_zero(action, barrier: str) -> None:
    """Runs a file-system change once per job (on process 0), the others waiting for it."""
    if jax.process_index() == 0:
        action()
    _barrier(barrier)


def _barrier(name: str) -> None:
    """Every process of a job reaches this point before any goes on (no-op for one)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
        multihost_utils.sync_global_devices(name)


def await_orbax_cleanup(manager: Any) -> None:
    """Waits for the thread an Orbax ``CheckpointManager`` starts on construction to remove
    unfinished temporary step directories (Orbax waits for it only in ``save()``). The method
    is private: ``tests/io/test_checkpointer.py`` fails if an Orbax renames it, rather than a
    run failing at its close."""
    await_cleanup = getattr(manager, "_maybe_await_cleanup_tmp_directory", None)
    if callable(await_cleanup):
        await_cleanup()
