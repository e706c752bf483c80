"""The index of lm-eval tasks: include_path's alone when it defines every named task, lm-eval's
whole index otherwise (tests/harness/local_tasks.py's tasks beside a built-in one)."""

from titanax.harness import task_index
from tests.harness import local_tasks


def test_local_tasks_skip_lm_evals_own_index_and_a_built_in_name_brings_it(tmp_path):
    folder = local_tasks.write(str(tmp_path / "tasks"))
    local = task_index.task_manager(include_path=folder, tasks=list(local_tasks.TASKS))
    # (Every task the folder defines: the named ones and the one not named.)
    assert sorted(local.all_tasks) == sorted((*local_tasks.TASKS, local_tasks.NEXT_TOKENS_TASK))
    # (lm-eval's whole index takes seconds to build: once here. An unknown name takes the same
    # path, so that lm-eval's index is the one that says it knows no such task.)
    mixed = task_index.task_manager(include_path=folder, tasks=["tiny_mc", "arc_easy"])
    assert {"tiny_mc", "arc_easy", "hellaswag"} <= set(mixed.all_tasks)
