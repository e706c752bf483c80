"""A local job's children forked from their launcher: each parses its own command line (none of
the launcher's flag values), runs in its own session and environment, reports through the
launcher's prefixed output and exit status -- and forking is refused where it is not safe (a
second thread, jax's backend started, a command not of the launcher's module)."""

import os
import subprocess
import sys

import jax

from titanax.runtime import forked_children

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _job(*exit_codes):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    return subprocess.run([sys.executable, "-m", "tests.runtime.forked_job", *exit_codes],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
                          check=False)


def test_children_run_on_the_launchers_imports_with_their_own_flags_session_and_env():
    result = _job("0", "0")
    assert result.returncode == 0, result.stdout + result.stderr
    launcher = int(result.stdout.split("launcher pid=")[1].split()[0])
    for index in (0, 1):
        assert (f"[{index}] greeting=child{index} count=1 parent={launcher} inherited=True "
                f"session_leader=True env=from the launcher\n") in result.stdout, result.stdout
        assert f"[{index}] to stderr\n" in result.stdout, result.stdout


def test_a_launcher_running_a_second_thread_starts_new_interpreters_alike():
    result = _job("thread", "0", "0")
    assert result.returncode == 0, result.stdout + result.stderr
    launcher = int(result.stdout.split("launcher pid=")[1].split()[0])
    for index in (0, 1):
        assert (f"[{index}] greeting=child{index} count=1 parent={launcher} inherited=False "
                f"session_leader=True env=from the launcher\n") in result.stdout, result.stdout


def test_a_forked_childs_failure_is_the_jobs_status_named():
    result = _job("0", "3")
    assert result.returncode == 3, result.stdout + result.stderr
    assert "process 1 of 2 failed with exit status 3" in result.stderr, result.stderr


def test_an_uncaught_interrupt_ends_a_forked_child_by_sigint_as_the_interpreter_does():
    result = _job("0", "-2")
    assert "[1] KeyboardInterrupt" in result.stdout, result.stdout
    assert "process 1 of 2 was killed by signal 2" in result.stderr, result.stderr


def test_forking_is_refused_where_it_is_not_safe():
    module = "titanax.runtime.forked_children"
    command = [sys.executable, "-u", "-m", module, "--flag"]
    assert forked_children.forkable_module([sys.executable, "-m", module]) is None
    assert forked_children.forkable_module(
        [sys.executable, "-u", "-m", "a_module_nobody_imported"]) is None
    jax.devices()  # This test process's backend: a child forked now would share its devices.
    assert forked_children.forkable_module(command) is None
