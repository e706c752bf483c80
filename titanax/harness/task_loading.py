"""lm-eval's tasks, loaded and checked before a model is: ``titanax.evaluate`` and the in-loop
evaler name what the user typed when a task cannot run.

lm-eval itself reports a task YAML that does not parse as an unknown task (its index skips the
file), a task whose data file is missing as a ``FileNotFoundError`` from deep inside ``datasets``
after the model has loaded, and more few-shot examples than a task holds as a ``ValueError`` from
``random.sample`` while it builds requests. Here each is an ``EvalTaskError`` at the flag or
config field that chose it, before the model loads (the tasks' data is read once more by
``lm_eval.simple_evaluate``: see ``check_loadable``). Needs lm-eval's ``TaskManager.load``
(0.4.12).
"""

from __future__ import annotations

import glob
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence

from titanax import errors

# Which flag or config field each kind of problem is reported at: keys "tasks", "include_path"
# and "num_fewshot", values the caller's names (``--tasks`` or ``evalers['lm_eval'].tasks``).
Paths = Mapping[str, str]


def unknown_tasks(*, manager: Any, tasks: Sequence[str], include_path: Optional[str],
                  paths: Paths) -> None:
    """Refuses task names lm-eval's index lacks; when ``include_path`` holds YAML files that do
    not parse, names them (lm-eval's index skips such a file: its task looks unknown)."""
    unknown = [t for t in tasks if t not in manager.all_tasks and not os.path.isfile(t)]
    if not unknown:
        return
    broken = _unparsable_yamls(include_path) if include_path else {}
    if broken:
        listed = "; ".join(f"{path}: {why}" for path, why in broken.items())
        raise errors.EvalTaskError(
            f"lm-eval knows no task {', '.join(unknown)}, and {len(broken)} task file(s) in "
            f"{include_path} do not parse: {listed}", path=paths["include_path"],
            suggestion="fix the YAML (indentation, quotes, brackets) at the line named")
    raise errors.EvalTaskError(
        f"lm-eval knows no task {', '.join(unknown)}", path=paths["tasks"],
        suggestion="check the names (python -m lm_eval ls tasks), or point include_path at the "
                   "directory of your task YAMLs")


def check_loadable(*, manager: Any, tasks: Sequence[str], num_fewshot: Optional[int],
                   paths: Paths) -> None:
    """Loads ``tasks`` once to check that each loads (its data found) and holds the few-shot
    examples it will be asked for. The tasks are built again by ``simple_evaluate``: lm-eval
    seeds Python's and numpy's generators before it builds them (a task's ``process_docs`` may
    shuffle), so handing it these would change seeded numbers."""
    try:
        loaded = manager.load(list(tasks))
    except Exception:  # pylint: disable=broad-except  (lm-eval's and datasets' errors, any kind)
        _raise_for_first_failing(manager, tasks, paths)
        raise
    for name, task in loaded["tasks"].items():
        _check_fewshot(name, task, num_fewshot, paths)


def _raise_for_first_failing(manager: Any, tasks: Sequence[str], paths: Paths) -> None:
    """Loads the tasks one at a time to name the one that fails, and why."""
    for name in tasks:
        try:
            manager.load([name])
        except Exception as e:  # pylint: disable=broad-except
            why = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise errors.EvalTaskError(
                f"task {name} does not load: {type(e).__name__}: {why}", path=paths["tasks"],
                suggestion="check the data files its YAML names (dataset_path, "
                           "dataset_kwargs.data_files) exist and are readable") from e


def _check_fewshot(name: str, task: Any, num_fewshot: Optional[int], paths: Paths) -> None:
    """lm-eval takes the few-shot examples from the task's few-shot split (or, lacking one, its
    training, validation or test docs) and, when that is the evaluated split, one more so that
    it can leave out the document being asked. ``num_fewshot`` replaces the task's own count
    unless its YAML fixes it at 0 (as ``simple_evaluate`` does)."""
    own = task.get_config("num_fewshot")
    shots = own if num_fewshot is None or own == 0 else num_fewshot
    if not shots:
        return
    sampler = getattr(task, "sampler", None)
    pool = len(sampler.df) if sampler is not None else 0
    cfg = getattr(task, "fewshot_cfg", None)
    # (lm-eval's own condition, None == None included: a task without a few-shot or test split
    # draws its examples from the evaluated documents.)
    needed = shots + (1 if getattr(cfg, "split", None) == task.config.test_split else 0)
    if pool < needed:
        where = paths["num_fewshot"] if num_fewshot is not None and own != 0 else paths["tasks"]
        raise errors.EvalTaskError(
            f"task {name} holds {pool} few-shot example(s); {shots}-shot needs {needed}"
            + (" (the asked document is left out of its own examples)" if needed > shots
               else ""), path=where,
            suggestion=f"ask for at most {max(pool - (needed - shots), 0)} few-shot examples, "
                       "or give the task more documents")


def _unparsable_yamls(include_path: str) -> Dict[str, str]:
    """Task files under ``include_path`` that YAML cannot parse, with the parser's problem and
    line. lm-eval's own tags (``!function``) are accepted as anything."""
    import yaml  # pylint: disable=import-outside-toplevel

    class TolerantLoader(yaml.SafeLoader):  # pylint: disable=too-many-ancestors
        """A safe loader that reads any ``!tag`` as null."""

    TolerantLoader.add_multi_constructor("!", lambda loader, suffix, node: None)
    broken = {}
    for path in sorted(glob.glob(os.path.join(include_path, "**", "*.y*ml"), recursive=True)):
        try:
            with open(path, encoding="utf-8") as f:
                yaml.load(f, Loader=TolerantLoader)  # nosec: a safe loader
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            mark = getattr(e, "problem_mark", None)
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            broken[path] = problem + (f" (line {mark.line + 1})" if mark is not None else "")
    return broken
