"""The --local_processes parent: child command lines, prefixed output, which failure is named."""

import io
import sys

from titanax.runtime import local_processes
from titanax.runtime.peer_watch import EXIT_LOST_PEER


def _python(code):
    return [sys.executable, "-c", code]


def test_children_get_their_place_in_the_job_and_lose_the_parents_flag():
    commands = local_processes.child_commands(
        ["--config=x", "--local_processes", "2", "--cpu_devices=8", "--config.a.b=1"],
        module="titanax.launch", count=2, port=1234, cpu_devices=4)
    assert commands[1][3:] == ["titanax.launch", "--config=x", "--config.a.b=1",
                               "--coordinator_address=127.0.0.1:1234", "--num_processes=2",
                               "--process_id=1", "--cpu_devices=4"]


def test_output_is_prefixed_and_success_is_zero():
    out = io.StringIO()
    status = local_processes.run_local_job([_python("print('hello')"), _python("print('hi')")],
                                           stdout=out)
    assert status == 0
    assert "[0] hello\n" in out.getvalue() and "[1] hi\n" in out.getvalue()


def test_the_real_failure_is_named_not_a_peer_that_lost_it(capfd):
    status = local_processes.run_local_job([
        _python(f"import sys, time; time.sleep(0.5); sys.exit({EXIT_LOST_PEER})"),
        _python("import sys, time; time.sleep(1.5); sys.exit(3)"),
        _python("import time; time.sleep(60)")], stdout=io.StringIO())
    assert status == 3
    assert "process 1 of 3 failed with exit status 3; stopped the other processes" in \
        capfd.readouterr().err


def test_every_process_ending_alike_is_said_so(capfd):
    status = local_processes.run_local_job([_python("import sys; sys.exit(143)")] * 2,
                                           stdout=io.StringIO())
    assert status == 143 and "every process failed with exit status 143" in capfd.readouterr().err


def test_children_keep_the_users_xla_flags_but_not_the_device_count(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_foo=1 --xla_force_host_platform_device_count=8")
    monkeypatch.setenv("TITANAX_PROCESS_ID", "3")
    env = local_processes._child_env(1, gpus_per_process=2)  # pylint: disable=protected-access
    assert env["XLA_FLAGS"] == "--xla_gpu_foo=1" and "TITANAX_PROCESS_ID" not in env
    assert env["JAX_LOCAL_DEVICE_IDS"] == "2,3"
