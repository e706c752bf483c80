"""A local job's children forked from their launcher: each parses its own command line (none of
the launcher's flag values), runs in its own session and environment, reports through the
launcher's prefixed output and exit status as a new interpreter would -- and forking is refused
where it is not safe (a second thread, jax's backend started, a command not of the launcher's
module)."""

import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(*args):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def _job(*outcomes):
    return _python("-m", "tests.runtime.forked_job", *outcomes)


def _child_line(result, index, *, inherited=True):
    launcher = int(result.stdout.split("launcher pid=")[1].split()[0])
    return (f"[{index}] greeting=child{index} count=1 parent={launcher} inherited={inherited} "
            f"session_leader=True env=from the launcher\n")


def test_children_run_on_the_launchers_imports_with_their_own_flags_session_and_env():
    result = _job("0", "0")
    assert result.returncode == 0, result.stdout + result.stderr
    for index in (0, 1):
        assert _child_line(result, index) in result.stdout, result.stdout
        assert f"[{index}] to stderr\n" in result.stdout, result.stdout
    assert result.stdout.count(" (forked from this launcher)\n") == 2, result.stdout
    assert "Warning" not in result.stdout + result.stderr, result.stdout + result.stderr


def test_a_launcher_running_a_second_thread_starts_new_interpreters_alike():
    result = _job("thread", "0", "0")
    assert result.returncode == 0, result.stdout + result.stderr
    for index in (0, 1):
        assert _child_line(result, index, inherited=False) in result.stdout, result.stdout
    assert "forked" not in result.stdout, result.stdout


@pytest.mark.parametrize("code,status", [(3, 3), (-1, 255), (257, 1)])
def test_a_forked_childs_failure_is_the_jobs_status_named(code, status):
    """As the interpreter exits: the status modulo 256 (sys.exit(-1) is 255)."""
    result = _job("0", str(code))
    assert _child_line(result, 1) in result.stdout, result.stdout
    assert result.returncode == status, result.stdout + result.stderr
    assert f"process 1 of 2 failed with exit status {status}" in result.stderr, result.stderr


def test_an_uncaught_interrupt_ends_a_forked_child_by_sigint_as_the_interpreter_does():
    result = _job("0", "interrupt")
    assert _child_line(result, 1) in result.stdout, result.stdout
    assert "[1] KeyboardInterrupt" in result.stdout, result.stdout
    assert "process 1 of 2 was killed by signal 2" in result.stderr, result.stderr


def test_forking_is_refused_where_it_is_not_safe():
    """In a process of its own: forkable, then not once jax has started (its devices would be
    shared), nor for a command without ``-u``, nor of a module this process has not imported."""
    result = _python("-c", "\n".join([
        "import sys, jax",
        "from titanax.runtime import forked_children as f",
        "module = 'titanax.runtime.forked_children'",
        "print(f.forkable_module([sys.executable, '-u', '-m', module, '--flag']))",
        "print(f.forkable_module([sys.executable, '-m', module, '--flag']))",
        "print(f.forkable_module([sys.executable, '-u', '-m', 'a_module_nobody_imported']))",
        "jax.devices()",
        "print(f.forkable_module([sys.executable, '-u', '-m', module, '--flag']))"]))
    assert result.stdout.split() == ["titanax.runtime.forked_children", "None", "None",
                                     "None"], result.stdout + result.stderr
