"""The local checkpoint tier: frequent saves to each host's own disk, each with a copy of a peer's.

Every ``local_every_n_steps`` steps each process writes the shards of the train state its devices
hold (and the data position) to ``<local_dir>/process_<P>/<step>/own``, and the shards of its
peer -- process ``P - 1`` -- to ``.../peer``: the peer's bytes arrive by one collective permute
over the processes, so a host that is lost, disk and all, is still held by its neighbour. The
copy off the devices and the permute block the step; the writing runs in a background thread
(a step directory is written as ``<step>.tmp`` and renamed when complete). Two steps are kept.

A restore (``restore``) takes the newest step every process can rebuild -- from its own files,
or from the copy its successor holds, sent back by the reverse permute -- when it is newer than
the persistent tier's newest; only onto the same processes and mesh (a run continued on other
hosts reads the persistent tier, resharded). The processes agree on the step from what each
found (an all-gather of their step lists), so they never restore different ones.

The persistent tier (Orbax, ``checkpointer.py``) is unchanged: the local tier only shortens
what a failure loses between its saves.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from titanax import errors
from titanax.parallel import collectives
from titanax.utils.files import unused_path

# Local steps kept per process.
KEEP = 2
# Steps each process reports when they agree on one (newest first).
_LISTED = 8


def check_writable(local_dir: str) -> str:
    """``local_dir`` made (if needed) and written to once; its absolute path."""
    full = os.path.abspath(local_dir)
    try:
        os.makedirs(full, exist_ok=True)
        with tempfile.TemporaryFile(dir=full):
            pass
    except OSError as e:
        raise errors.CheckpointError(
            f"cannot write into {full}: {e.strerror or e}", path="checkpoint.local_dir",
            suggestion="name a directory on this host's local disk that you can write to") from e
    return full


def _pack(leaves: List[Tuple[str, List[Tuple[Any, np.ndarray]]]], extra: Dict[str, Any]
          ) -> np.ndarray:
    """Shards (each ``(index, array)``) of every leaf and a JSON ``extra``, as one byte row."""
    header = {"extra": extra, "leaves": []}
    chunks = []
    for name, shards in leaves:
        entries = []
        for index, array in shards:
            array = np.asarray(array, order="C")  # (ascontiguousarray makes 0-d arrays 1-d.)
            entries.append({"index": [[s.start, s.stop] for s in index],
                            "shape": list(array.shape), "dtype": array.dtype.str,
                            "bytes": int(array.nbytes)})
            chunks.append(array.reshape(-1).view(np.uint8))
        header["leaves"].append({"name": name, "shards": entries})
    text = json.dumps(header).encode("utf-8")
    size = np.frombuffer(np.int64(len(text)).tobytes(), np.uint8)
    return np.concatenate([size, np.frombuffer(text, np.uint8), *chunks])


def _unpack(row: np.ndarray) -> Tuple[Dict[str, Any], Dict[str, Dict[Tuple, np.ndarray]]]:
    """``(extra, {leaf: {index: array}})`` of a ``_pack`` row."""
    size = int(np.frombuffer(row[:8].tobytes(), np.int64)[0])
    header = json.loads(row[8:8 + size].tobytes().decode("utf-8"))
    offset, leaves = 8 + size, {}
    for leaf in header["leaves"]:
        shards = {}
        for entry in leaf["shards"]:
            data = row[offset:offset + entry["bytes"]]
            offset += entry["bytes"]
            shards[tuple(tuple(pair) for pair in entry["index"])] = np.frombuffer(
                data.tobytes(), np.dtype(entry["dtype"])).reshape(entry["shape"])
        leaves[leaf["name"]] = shards
    return header["extra"], leaves


def _slices(index: Tuple[slice, ...], shape: Tuple[int, ...]) -> Tuple[slice, ...]:
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


class LocalTier:
    """One process's local tier (see the module docstring)."""

    def __init__(self, *, local_dir: str, every_n_steps: int, run: str):
        """``run``: the persistent tier's directory, whose run this tier belongs to (its steps
        are kept under a name of its own: a local dir shared by runs never mixes them)."""
        key = hashlib.sha256(run.encode("utf-8")).hexdigest()[:12]
        name = "-".join(run.rstrip("/").split("/")[-2:]) or "run"
        self.root = os.path.join(check_writable(local_dir), f"{name}-{key}")
        self.every_n_steps = every_n_steps
        self.process = jax.process_index()
        self.processes = jax.process_count()
        self._writer: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def directory(self, process: int) -> str:
        return os.path.join(self.root, f"process_{process}")

    def should_save(self, step: int) -> bool:
        return step % self.every_n_steps == 0

    def set_aside(self) -> None:
        """A fresh run in this run's place: this process's local steps are an older run's;
        moved aside (kept, like the persistent tier's)."""
        folder = self.directory(self.process)
        if self._steps(folder):
            os.replace(folder, unused_path(f"{folder}.superseded-{time.strftime('%Y%m%dT%H%M%S')}"))

    # --- Saving ----------------------------------------------------------------------------------

    def save(self, tree: Dict[str, Any], *, step: int, data_state: Any,
             metadata: Dict[str, Any]) -> None:
        """Starts writing ``tree`` (global arrays) as ``step``: this process's shards and its
        peer's (received now); the files are written in the background."""
        self.wait()
        leaves = [(jax.tree_util.keystr(path), self._unique_shards(leaf))
                  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]
        own = _pack(leaves, {"step": step, "data_state": data_state, "metadata": metadata})
        peer = self._permute(own, shift=1) if self.processes > 1 else None
        self._writer = threading.Thread(target=self._write, args=(step, own, peer),
                                        name="titanax-local-tier", daemon=True)
        self._writer.start()

    @staticmethod
    def _unique_shards(leaf: jax.Array) -> List[Tuple[Tuple[slice, ...], np.ndarray]]:
        """The distinct parts of ``leaf`` this process holds (a replicated part once)."""
        found: Dict[Tuple, Tuple[Tuple[slice, ...], np.ndarray]] = {}
        for shard in leaf.addressable_shards:
            index = _slices(shard.index, leaf.shape)
            key = tuple((s.start, s.stop) for s in index)
            if key not in found:
                found[key] = (index, np.asarray(shard.data))
        return list(found.values())

    def _write(self, step: int, own: np.ndarray, peer: Optional[np.ndarray]) -> None:
        try:
            folder = self.directory(self.process)
            final = os.path.join(folder, str(step))
            partial = final + ".tmp"
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
            np.save(os.path.join(partial, "own.npy"), own)
            if peer is not None:
                np.save(os.path.join(partial, "peer.npy"), peer)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            for old in self._steps(folder)[:-KEEP]:
                shutil.rmtree(os.path.join(folder, str(old)), ignore_errors=True)
        except BaseException as e:  # pylint: disable=broad-except
            self._error = e

    def wait(self) -> None:
        """Waits for the write in flight; raises CheckpointError if it failed."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise errors.CheckpointError(
                f"writing the local checkpoint tier failed: {type(error).__name__}: {error}",
                path="checkpoint.local_dir",
                suggestion="check the local disk (space, permissions)") from error

    # --- Restoring -------------------------------------------------------------------------------

    @staticmethod
    def _steps(folder: str) -> List[int]:
        if not os.path.isdir(folder):
            return []
        return sorted(int(n) for n in os.listdir(folder) if n.isdigit())

    def _holdings(self) -> np.ndarray:
        """``[own steps..., peer-copy steps...]`` of this process (newest first, -1 padded)."""
        folder = self.directory(self.process)
        own = [s for s in self._steps(folder)
               if os.path.isfile(os.path.join(folder, str(s), "own.npy"))][::-1][:_LISTED]
        peer = [s for s in self._steps(folder)
                if os.path.isfile(os.path.join(folder, str(s), "peer.npy"))][::-1][:_LISTED]
        row = np.full(2 * _LISTED, -1, np.int64)
        row[:len(own)], row[_LISTED:_LISTED + len(peer)] = own, peer
        return row

    def newest_restorable(self) -> Optional[int]:
        """The newest step every process can rebuild (agreed by all); None when there is none."""
        table = np.asarray(multihost_utils.process_allgather(self._holdings())).reshape(
            self.processes, 2 * _LISTED)
        own = [set(int(s) for s in row[:_LISTED] if s >= 0) for row in table]
        peer = [set(int(s) for s in row[_LISTED:] if s >= 0) for row in table]
        candidates = set().union(*own) | set().union(*peer)
        whole = [s for s in candidates
                 if all(s in own[q] or (self.processes > 1 and s in peer[(q + 1) % self.processes])
                        for q in range(self.processes))]
        return max(whole) if whole else None

    def read(self, step: int) -> Tuple[Dict[str, Any], Dict[str, Dict[Tuple, np.ndarray]]]:
        """``(extra, shards)`` of this process at local ``step``: from its own file, or (when
        some process lost its own) from its successor's copy, sent back."""
        folder = os.path.join(self.directory(self.process), str(step))
        own_path, peer_path = os.path.join(folder, "own.npy"), os.path.join(folder, "peer.npy")
        mine = np.load(own_path) if os.path.isfile(own_path) else None
        lacking = np.asarray(multihost_utils.process_allgather(np.int64(mine is None)))
        if self.processes > 1 and lacking.any():  # (Copies move only when one is needed.)
            lost_by_predecessor = bool(lacking.reshape(-1)[(self.process - 1) % self.processes])
            held = np.load(peer_path) if lost_by_predecessor else None
            returned = self._permute(held, shift=-1)
            if mine is None:
                mine = returned
        if mine is None or mine.size == 0:
            raise errors.CheckpointError(
                f"local step {step} of process {self.process} is neither on its disk nor held "
                "by its peer", path=folder, suggestion="restart from the persistent tier")
        return _unpack(mine)

    @staticmethod
    def place(shards: Dict[str, Dict[Tuple, np.ndarray]], targets: Dict[str, Any]
              ) -> Dict[str, Any]:
        """``targets`` (ShapeDtypeStructs with shardings) filled from ``read``'s shards."""
        def fill(path, target):
            saved = shards[jax.tree_util.keystr(path)]
            placed = []
            for device, index in target.sharding.addressable_devices_indices_map(
                    target.shape).items():
                key = tuple((s.start, s.stop) for s in _slices(index, target.shape))
                placed.append(jax.device_put(saved[key], device))
            return jax.make_array_from_single_device_arrays(target.shape, target.sharding,
                                                            placed)
        return jax.tree_util.tree_map_with_path(fill, targets)

    # --- The peer exchange -----------------------------------------------------------------------

    def _permute(self, row: Optional[np.ndarray], *, shift: int) -> np.ndarray:
        """Every process's ``row`` (None: empty) sent to process ``P + shift``; the row this
        process receives (rows padded to the longest, then cut to the sender's length)."""
        row = np.zeros((0,), np.uint8) if row is None else row
        lengths = np.asarray(multihost_utils.process_allgather(np.int64(row.size))).reshape(-1)
        width = max(int(lengths.max()), 1)
        hosts = [jax.local_devices(process_index=p)[0] for p in range(self.processes)]
        mesh = Mesh(np.array(hosts), ("hosts",))
        sharding = NamedSharding(mesh, PartitionSpec("hosts"))
        local = np.zeros((1, width), np.uint8)
        local[0, :row.size] = row
        spread = jax.make_array_from_single_device_arrays(
            (self.processes, width), sharding, [jax.device_put(local, hosts[self.process])])
        pairs = [(p, (p + shift) % self.processes) for p in range(self.processes)]
        moved = jax.jit(jax.shard_map(
            lambda x: collectives.ppermute(x, "hosts", pairs), mesh=mesh,
            in_specs=PartitionSpec("hosts"), out_specs=PartitionSpec("hosts")))(spread)
        received = np.asarray(moved.addressable_shards[0].data)[0]
        sender = (self.process - shift) % self.processes
        return received[:int(lengths[sender])]
