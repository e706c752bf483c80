"""The index of lm-eval tasks: include_path's alone when it defines every named task, lm-eval's
whole index otherwise (tests/harness/local_tasks.py's tasks beside a built-in one)."""

from titanax.harness import task_index
from tests.harness import local_tasks


def test_local_tasks_skip_lm_evals_own_index_and_a_built_in_name_brings_it(tmp_path):
    folder = local_tasks.write(str(tmp_path / "tasks"))
    local = task_index.task_manager(include_path=folder, tasks=list(local_tasks.TASKS))
    assert sorted(local.all_tasks) == sorted(local_tasks.TASKS)
    mixed = task_index.task_manager(include_path=folder, tasks=["tiny_mc", "arc_easy"])
    assert {"tiny_mc", "arc_easy", "hellaswag"} <= set(mixed.all_tasks)
    unknown = task_index.task_manager(include_path=folder, tasks=["no_such_task"])
    assert "no_such_task" not in unknown.all_tasks and "arc_easy" in unknown.all_tasks
    built_in = task_index.task_manager(include_path=None, tasks=["arc_easy"])
    assert "arc_easy" in built_in.all_tasks
