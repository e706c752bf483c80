"""A launcher for tests/runtime/test_forked_children.py: parses its own flags as
``tests.runtime.forked_child_main`` (``--greeting=launcher --count=5``), then runs a local job
of that module with other flags, a child per argument (its exit status, or ``interrupt``) --
forked, since this process runs one thread and no jax backend; with ``thread`` first among its
arguments, a second thread runs, and the children are new interpreters. Exits with the job's
status."""

import os
import sys
import threading

from absl import flags

from tests.runtime import forked_child_main  # pylint: disable=unused-import
from tests.runtime import launcher_only  # pylint: disable=unused-import
from titanax.runtime import local_processes

if __name__ == "__main__":
    flags.FLAGS(["launcher", "--greeting=launcher", "--count=5"])
    outcomes = sys.argv[1:]
    if outcomes[0] == "thread":
        outcomes.pop(0)
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    os.environ["FORKED_CHILD_TEST"] = "from the launcher"
    commands = [[sys.executable, "-u", "-m", "tests.runtime.forked_child_main",
                 f"--greeting=child{index}",
                 "--interrupt" if outcome == "interrupt" else f"--exit_code={outcome}"]
                for index, outcome in enumerate(outcomes)]
    print(f"launcher pid={os.getpid()}", flush=True)
    sys.exit(local_processes.run_local_job(commands))
