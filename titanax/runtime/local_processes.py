"""``--local_processes=N``: one command runs an N-process job on this machine, over loopback.

The parent picks a free port, starts N copies of the same command line (forked from itself where
it can: ``forked_children``), each told its place in the job (``--coordinator_address=
127.0.0.1:PORT --num_processes=N --process_id=i``) and given its devices (``--cpu_devices=K``: K
simulated CPU devices each; without it, a slice of the visible GPUs through
``JAX_LOCAL_DEVICE_IDS``). Every line a child prints comes out prefixed with its index (``[1]
step 10 ...``). The parent forwards SIGTERM / SIGINT to every child (the job then agrees on a
step to save, like a preempted multi-host job) and, on the first child that fails, stops the
others and exits with that child's status, naming it. It never imports jax.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional, Sequence

from titanax import errors
from titanax.runtime import forked_children
from titanax.runtime.peer_watch import EXIT_LOST_PEER
from titanax.utils import command_args

# Seconds a child gets to exit after SIGTERM before it is killed (when a peer failed).
_GRACE_S = 20.0
# Set in every child: the launcher's pid (die_with_launcher).
ENV_LAUNCHER_PID = "TITANAX_LAUNCHER_PID"
# Seconds the others get to end by themselves after a child failed (before being stopped).
_SETTLE_S = 3.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def visible_gpus() -> int:
    """The number of NVIDIA GPUs this machine shows (0 when none or no driver)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return len([d for d in listed.split(",") if d.strip()])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20,
                             check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def child_commands(args: Sequence[str], *, module: str, count: int, port: int,
                   cpu_devices: Optional[int]) -> List[List[str]]:
    """The command line of each child: ``python -m module`` with ``args`` (the parent's flags)
    minus ``--local_processes``, plus its place in the job."""
    kept = command_args.without_flags(args, ("local_processes", "cpu_devices",
                                              "coordinator_address", "num_processes",
                                              "process_id"))
    commands = []
    for index in range(count):
        place = [f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={count}",
                 f"--process_id={index}"]
        if cpu_devices is not None:
            place.append(f"--cpu_devices={cpu_devices}")
        commands.append([sys.executable, "-u", "-m", module] + kept + place)
    return commands


def run_local_job(commands: Sequence[Sequence[str]], *, gpus_per_process: int = 0,
                  stdout=None) -> int:
    """Runs the children, prefixing their output; returns the job's exit status."""
    stdout = stdout or sys.stdout
    lock = threading.Lock()
    children: List = []  # subprocess.Popen or forked_children.ForkedChild
    signals_seen = []

    def forward(signum, frame):  # pylint: disable=unused-argument
        # SIGHUP (the terminal went away) asks for a clean stop like SIGTERM; the children
        # have no handler of their own for it.
        signals_seen.append(signal.SIGTERM if signum == signal.SIGHUP else signum)
        for child in children:
            if child.poll() is None:  # A second signal: the job is stuck, kill it.
                child.send_signal(signals_seen[0] if len(signals_seen) == 1 else signal.SIGKILL)

    previous = {sig: signal.signal(sig, forward)
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    readers = []
    try:
        for index, command in enumerate(commands):
            children.append(_start_child(command, env=_child_env(index, gpus_per_process),
                                         siblings=children, gpus=gpus_per_process))
            if signals_seen:  # A signal that came while the job was starting.
                children[-1].send_signal(signals_seen[0])
            forked = isinstance(children[-1], forked_children.ForkedChild)
            print(f"titanax.launch: process {index} of {len(commands)} is pid "
                  f"{children[-1].pid}" + " (forked from this launcher)" * forked, file=stdout,
                  flush=True)
        readers = [threading.Thread(target=_relay, args=(child, index, stdout, lock), daemon=True)
                   for index, child in enumerate(children)]
        for reader in readers:
            reader.start()
        return _wait(children)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for reader in readers:
            reader.join(timeout=5)


def _start_child(command: Sequence[str], *, env: dict, siblings: Sequence[object], gpus: int):
    """The child forked from this process where it can be (``forked_children``: the imports it
    would make again are made), else a new interpreter. A job given GPUs always starts new
    interpreters: forking has not been tried on GPUs."""
    module = None if gpus else forked_children.forkable_module(command)
    if module is not None:
        return forked_children.start(module, command[4:], env=env, siblings=siblings)
    return subprocess.Popen(  # pylint: disable=consider-using-with
        list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        errors="replace", bufsize=1, start_new_session=True)


def _child_env(index: int, gpus_per_process: int) -> dict:
    env = dict(os.environ)
    # Each child sets its own device count; the user's other XLA flags stay.
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                   env.get("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    for name in ("TITANAX_COORDINATOR_ADDRESS", "TITANAX_NUM_PROCESSES", "TITANAX_PROCESS_ID",
                 "JAX_COORDINATOR_ADDRESS"):
        env.pop(name, None)
    env["PYTHONUNBUFFERED"] = "1"
    env[ENV_LAUNCHER_PID] = str(os.getpid())
    if gpus_per_process:
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(
            str(index * gpus_per_process + i) for i in range(gpus_per_process))
    return env


def die_with_launcher() -> None:
    """In a child, first thing: be SIGKILLed when the launcher dies (Linux PR_SET_PDEATHSIG), so
    no orphan trains on; exit if it is gone already. The child does this itself (the launcher
    names itself in ``TITANAX_LAUNCHER_PID``) rather than in a pre-exec hook, which would make
    subprocess fork a possibly multithreaded parent."""
    launcher = os.environ.get(ENV_LAUNCHER_PID)
    if not launcher:
        return
    try:
        import ctypes  # pylint: disable=import-outside-toplevel
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(launcher):
        os._exit(1)  # pylint: disable=protected-access


def _relay(child, index: int, stdout, lock: threading.Lock) -> None:
    for line in child.stdout:
        with lock:
            stdout.write(f"[{index}] {line}" if line.endswith("\n") else f"[{index}] {line}\n")
            stdout.flush()


def _wait(children: List) -> int:
    """The job's status: 0 when every child succeeded; else the first real failure's, named.
    A child that stopped because its peer was lost (peer_watch.EXIT_LOST_PEER) is not the cause
    when another child failed otherwise; all children stopping with the same status (e.g. an
    agreed preemption without a checkpoint: 143) is reported as such, not as one's failure."""
    while all(child.poll() in (None, 0) for child in children):
        if all(child.poll() == 0 for child in children):
            return 0
        time.sleep(0.1)
    first = next(i for i, child in enumerate(children) if child.poll() not in (None, 0))
    deadline = time.monotonic() + _SETTLE_S  # Let the others end on their own first.
    while time.monotonic() < deadline and any(child.poll() is None for child in children):
        time.sleep(0.1)
    codes = [child.poll() for child in children]
    causes = [i for i, code in enumerate(codes) if code not in (None, 0, EXIT_LOST_PEER)]
    if codes[0] is not None and codes[0] < 0 and codes[0] != -signal.SIGABRT:
        failed = 0  # Process 0 (jax's service) was killed: the others' aborts followed it.
    else:
        failed = causes[0] if causes and codes[first] == EXIT_LOST_PEER else first
    _stop_the_rest(children, failed)
    code = children[failed].returncode
    if all(child.returncode == code for child in children):
        print(f"titanax.launch: every process {_status_text(code)}", file=sys.stderr,
              flush=True)
    else:
        print(f"titanax.launch: process {failed} of {len(children)} {_status_text(code)}; "
              "stopped the other processes", file=sys.stderr, flush=True)
    return code if code > 0 else 128 - code


def _status_text(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"failed with exit status {code}"


def _stop_the_rest(children: List, failed: int) -> None:
    for index, child in enumerate(children):
        if index != failed and child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for child in children:
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if child.poll() is None:
            child.kill()
            child.wait()


def check_count(count: int) -> None:
    if count < 1:
        raise errors.LaunchFlagError(f"must be >= 1, got {count}", path="--local_processes",
                                     suggestion="e.g. --local_processes=2")
