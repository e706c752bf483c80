"""Preemption state is a process's own: a stop request recorded in a launcher is not its forked
children's (a local job's processes are forked from it: titanax/runtime/forked_children.py)."""

import json
import os

from titanax.train import preemption


def test_a_forked_process_starts_with_no_stop_request_of_its_parents():
    kept = preemption._EARLY  # pylint: disable=protected-access
    try:
        preemption._EARLY = preemption._EarlyGuard()  # pylint: disable=protected-access
        preemption._EARLY.requested, preemption._EARLY.signal_name = True, "SIGTERM"  # pylint: disable=protected-access
        assert preemption.early_request() == "SIGTERM"
        reader, writer = os.pipe()
        pid = os.fork()
        if pid == 0:  # (The child reports and leaves without running anything else.)
            os.write(writer, json.dumps({"request": preemption.early_request()}).encode())
            os._exit(0)  # pylint: disable=protected-access
        os.close(writer)
        with os.fdopen(reader) as f:
            child = json.loads(f.read())
        os.waitpid(pid, 0)
        assert preemption.early_request() == "SIGTERM"  # (The parent's own is kept.)
    finally:
        preemption._EARLY = kept  # pylint: disable=protected-access
    assert child == {"request": None}, child
