"""Two real processes on loopback, joined by titanax.runtime.distributed.initialize."""

import os
import subprocess
import sys

import pytest

from titanax.runtime import local_processes
from tests import forked_python
from tests.environment import child_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_free_port = local_processes.free_port


@pytest.mark.parametrize("mode", ["", "late_stop"])
def test_psum_across_two_processes(mode):
    """With ``late_stop`` process 0's watch still runs 3 s after process 1 left in order (CI saw
    this: 'lost process 1' after a finished run, exit 75); a peer that said it left is not lost."""
    port = _free_port()
    env = child_environment()
    workers = [subprocess.Popen([sys.executable, "-m", "tests.runtime.distributed_worker", str(i),
                                 str(port), *([mode] if mode else [])], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = []
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=180)
            outputs.append((worker.returncode, out, err))
    finally:
        for worker in workers:
            worker.kill()
    for index, (code, out, err) in enumerate(outputs):
        assert code == 0, f"process {index} failed:\n{out}\n{err}"
        assert f"RESULT process={index} ranks={[2 * index, 2 * index + 1]} psum=[10.0, 10.0]" \
            in out, out + err
        assert f"titanax process {index}/2: 2 local / 4 global cpu device(s) [flags]" in err


def test_unreachable_coordinator_is_a_distributed_error():
    code = ("from titanax.runtime.cpu_devices import simulate_cpu_devices; simulate_cpu_devices(1)\n"
            "from titanax import errors\nfrom titanax.runtime import distributed\n"
            "try:\n"
            f"    distributed.initialize('127.0.0.1:{_free_port()}', 2, 1, timeout_s=3)\n"
            "except errors.DistributedError as e:\n"
            "    print('DISTRIBUTED-ERROR', e.path, '|', e.suggestion)\n")
    result = forked_python.run(["-c", code], cwd=REPO_ROOT, timeout=120)
    assert "DISTRIBUTED-ERROR coordinator 127.0.0.1:" in result.stdout, result.stdout + result.stderr
    assert "check that process 0 runs" in result.stdout
