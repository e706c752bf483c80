"""Writing files so that a crash never leaves a half-written one behind."""

from __future__ import annotations

import os
import tempfile
import time


def _file_mode() -> int:
    """The mode ``open()`` would give a new file (0644 under the usual umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


_FILE_MODE = _file_mode()


def atomic_write_text(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` via a temporary file and a rename (atomic on POSIX).

    The file gets the same permissions as one made by ``open()`` (``mkstemp`` alone would make
    it 0600, unreadable to the rest of a team sharing the run directory).
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, tmp_path = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.",
                                        suffix=".tmp")
    try:
        os.chmod(tmp_path, _FILE_MODE)
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise


def unused_path(path: str) -> str:
    """``path``, or ``path-2``, ``path-3``... whichever does not exist yet (for moving a file or
    directory aside without replacing an earlier one)."""
    from etils import epath  # pylint: disable=import-outside-toplevel
    candidate, index = path, 1
    while epath.Path(candidate).exists():
        index += 1
        candidate = f"{path}-{index}"
    return candidate


def move_aside(path: str) -> str:
    """Renames ``path`` (a file or directory an earlier run wrote) to ``<root>.<time><ext>``
    (``unused_path``: never over another), so a new run's output does not mix with it; returns
    the new path."""
    root, ext = os.path.splitext(path)
    aside = unused_path(f"{root}.{time.strftime('%Y%m%dT%H%M%S')}{ext}")
    os.replace(path, aside)
    return aside


def file_target_problem(path: str) -> str:
    """Why a file cannot be written at ``path`` (a directory there, a file where a parent
    directory would be, a parent that cannot be written), or "" when it can: checked before a
    command spends its time on what it would write."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        return f"{path} is a directory"
    parent = os.path.dirname(target)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{path} lies under {parent}, a file"
    if not os.access(parent, os.W_OK):
        return f"{parent} cannot be written"
    return ""
