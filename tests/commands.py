"""Titanax's commands run as a user runs them: ``python -m <module> <flags>`` in a child
process from the repository root, with the test session's environment (tests/environment.py),
forked from an interpreter that has imported jax already (tests/forked_python.py)."""

import os
import re
import signal
import subprocess
from typing import List, Tuple

from tests import forked_python
from tests.environment import child_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_module(module: str, *args: str, expect: int = 0,
               quick_backend: bool = True) -> subprocess.CompletedProcess:
    """The finished command, its exit status checked (``expect``), its output in the message
    when it differs. ``quick_backend=False``: a command that trains for many steps, which LLVM's
    optimisations pay for (tests/environment.py)."""
    result = forked_python.run(["-m", module, *args], cwd=REPO_ROOT,
                               env=child_environment(quick_backend=quick_backend), timeout=600)
    assert result.returncode == expect, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def sigterm_after_step(argv: List[str], *, step: int, env) -> Tuple[List[str], str]:
    """``(lines before the signal, the rest of the output)`` of ``argv`` (a launch) sent SIGTERM
    once it prints step ``step``'s progress line; it must then exit 0 (a run stops cleanly)."""
    process = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if re.match(rf"step\s+{step}/", line):
            process.send_signal(signal.SIGTERM)
            break
    rest = process.communicate(timeout=120)[0]
    assert process.returncode == 0, "".join(lines) + rest
    return lines, rest
