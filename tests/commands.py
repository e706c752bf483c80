"""Titanax's commands run as a user runs them: ``python -m <module> <flags>`` in a child
process from the repository root, with the test session's environment (tests/environment.py)."""

import os
import subprocess
import sys

from tests.environment import child_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_module(module: str, *args: str, expect: int = 0,
               quick_backend: bool = True) -> subprocess.CompletedProcess:
    """The finished command, its exit status checked (``expect``), its output in the message
    when it differs. ``quick_backend=False``: a command that trains for many steps, which LLVM's
    optimisations pay for (tests/environment.py)."""
    result = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT,
                            env=child_environment(quick_backend=quick_backend), capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == expect, result.stdout[-3000:] + result.stderr[-3000:]
    return result
