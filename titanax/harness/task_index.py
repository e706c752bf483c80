"""lm-eval's index of tasks, built as narrow as the named tasks allow.

lm-eval's ``TaskManager`` reads every YAML of its own thousands of tasks to index them (measured:
5.7 s of a 2-core machine, at every ``titanax.evaluate`` and every run with an lm-eval evaler).
When ``include_path`` alone defines every named task, as plain tasks, the index of that directory
serves; otherwise -- a built-in task, a group or tag, a task given as a file -- lm-eval's whole
index with ``include_path`` added, as before.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence


def task_manager(*, include_path: Optional[str], tasks: Sequence[str]) -> Any:
    """A ``TaskManager`` that knows ``tasks`` (see the module docstring)."""
    from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel
    if include_path and tasks:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(name in local.all_subtasks for name in tasks):
            return local
    return TaskManager(include_path=include_path)
