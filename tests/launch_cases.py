"""Many launches in one child process: ``python -m tests.launch_cases CASES.json RESULTS.json``
(launches refused before they start a run, and short trainings).

Each case is ``{"args": [launcher flags...], "cwd": DIR}``; its result ``{"returncode",
"stdout", "stderr"}`` is what ``python -m titanax.launch ARGS`` run in ``DIR`` would give: the
launcher's own flag parsing and ``main`` (``titanax/launch.py``), the flags reset to their
defaults before each case, the streams captured. A fresh interpreter per case would repeat the same second of imports 35 times
(tests/test_launch_errors.py); the process entry (signal handlers, protected streams) is
exercised by the tests that launch the real command.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback
from typing import Dict, List

from tests import forked_python


def run_case(args: List[str], cwd: str) -> Dict[str, object]:
    """One launch of ``args`` in ``cwd``: its exit status and captured output."""
    from absl import flags  # pylint: disable=import-outside-toplevel
    from titanax import launch  # pylint: disable=import-outside-toplevel
    flags.FLAGS.unparse_flags()
    stdout, stderr = io.StringIO(), io.StringIO()
    returncode = 0
    before = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                rest = launch._parse_flags(["titanax.launch", *args])  # pylint: disable=protected-access
                launch.main(rest)
            except SystemExit as e:
                returncode = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # pylint: disable=broad-except
                traceback.print_exc()  # (As the interpreter would: the test reads it.)
                returncode = 1
    finally:
        os.chdir(before)
    return {"returncode": returncode, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


def launch_in_one_child(cases: List[Dict[str, object]], *, folder: str, env: Dict[str, str],
                        timeout: int = 1800) -> List[Dict[str, object]]:
    """Every case run by ``python -m tests.launch_cases`` in one child process (the cases and
    results files written in ``folder``): their results, in order; the child's own failure
    (an abort, a timeout) fails the calling test with its output."""
    given = os.path.join(folder, "cases.json")
    got = os.path.join(folder, "results.json")
    with open(given, "w", encoding="utf-8") as f:
        json.dump(cases, f)
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = forked_python.run(["-m", "tests.launch_cases", given, got],
                            cwd=repo_root, env=env,
                            timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(got, encoding="utf-8") as f:
        return json.load(f)


def main(cases_path: str, results_path: str) -> None:
    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)
    results = [run_case(case["args"], case["cwd"]) for case in cases]
    with open(results_path, "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
