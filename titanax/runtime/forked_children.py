"""A local job's processes forked from its launcher instead of started as new interpreters.

The launcher of ``--local_processes=N`` has imported what each of its N children imports first
(jax, optax, Orbax, grain, Titanax and its experiments: ~3 s of CPU per process, measured on
2 cores) and has not started jax's backend, which reads the device count and ``XLA_FLAGS`` only
when it starts. So a child can be this process, forked: it takes its own session, environment,
output pipe and command line, then runs the launcher's module afresh as ``__main__`` -- the same
code ``python -u -m module`` would run, on the imports already made.

Forking is chosen only where it is safe: on POSIX, while this process runs one thread and jax
has no backend, and for a command ``[python, -u, -m, module, ...]`` whose module this process
has imported (its flags are forgotten first, so the fresh run defines and parses them anew).
Everything else -- a job given GPUs (which jax picks from the environment when it is imported),
a launcher that started jax -- starts new interpreters (``subprocess.Popen``) as before.
"""

from __future__ import annotations

import atexit
import io
import os
import runpy
import signal
import sys
import threading
import traceback
from typing import Dict, Optional, Sequence

def forkable_module(command: Sequence[str]) -> Optional[str]:
    """The module of ``command`` when it can run forked from this process, else None."""
    if len(command) < 4 or list(command[:3]) != [sys.executable, "-u", "-m"]:
        return None
    module = command[3]
    if (not hasattr(os, "fork") or threading.active_count() != 1 or _jax_backend_started()
            or _loaded_module(module) is None):
        return None
    return module


class ForkedChild:
    """What the launcher uses of a ``subprocess.Popen`` (pid, stdout, poll, wait, send_signal,
    kill, returncode), for a child forked by ``start``."""

    def __init__(self, pid: int, stdout: io.TextIOBase):
        self.pid = pid
        self.stdout = stdout
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(module: str, args: Sequence[str], *, env: Dict[str, str],
          siblings: Sequence[object] = ()) -> ForkedChild:
    """Forks a child that runs ``python -u -m module *args`` in ``env``, its stdout and stderr
    one text pipe (``.stdout``) like ``Popen(..., stdout=PIPE, stderr=STDOUT, text=True,
    start_new_session=True)``. ``siblings``: children started before, whose pipes it closes."""
    read_end, write_end = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # (Nothing buffered is written twice.)
        stream.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        for sibling in siblings:
            sibling.stdout.close()
        _become(module, list(args), env=env, output=write_end)
    os.close(write_end)
    return ForkedChild(pid, os.fdopen(read_end, "r", errors="replace", buffering=1))


def _become(module: str, args: Sequence[str], *, env: Dict[str, str], output: int) -> None:
    """The child's side: never returns."""
    code = 1
    try:
        os.setsid()
        # A new interpreter's handlers (the launcher's own forward signals to its children).
        for sig, handler in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGHUP, signal.SIG_DFL),
                             (signal.SIGINT, signal.default_int_handler)):
            signal.signal(sig, handler)
        for fd in (1, 2):
            os.dup2(output, fd)
        os.close(output)
        # Unbuffered like ``python -u``: each line reaches the launcher as it is printed.
        sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False),  # pylint: disable=consider-using-with
                                      encoding="utf-8", write_through=True)
        sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False),  # pylint: disable=consider-using-with
                                      encoding="utf-8", errors="backslashreplace",
                                      write_through=True)
        os.environ.clear()
        os.environ.update(env)
        _forget_flags_of(module)
        sys.argv = [_loaded_module(module).__file__, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = exit_code(e.code)
    except KeyboardInterrupt:  # As the interpreter: the traceback, then death by SIGINT.
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # pylint: disable=broad-except
        traceback.print_exc()
    exit_like_the_interpreter(code)


def exit_code(code: object) -> int:
    """The exit status of ``SystemExit(code)``, as the interpreter makes it (a message is
    printed to stderr, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_like_the_interpreter(code: int) -> None:
    """Ends a forked process as the interpreter ends one: waits for its non-daemon threads, runs
    its exit handlers, flushes its streams -- then leaves at once (``os._exit``: the parent's
    exit handlers, copied by the fork, are not this process's). A negative ``code``: killed by
    that signal, as by an uncaught KeyboardInterrupt (-SIGINT)."""
    try:
        threading._shutdown()  # pylint: disable=protected-access
        atexit._run_exitfuncs()  # pylint: disable=protected-access
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code)  # pylint: disable=protected-access


def _loaded_module(module: str):
    """The module as this process imported it: by its name, or as ``__main__``."""
    if module in sys.modules:
        return sys.modules[module]
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return main if spec is not None and spec.name == module else None


def _forget_flags_of(module: str) -> None:
    """Removes the absl flags ``module`` defined (its fresh run defines them again) and returns
    every other flag to its default, unparsed (the child's command line is parsed anew)."""
    if "absl.flags" not in sys.modules:
        return
    from absl import flags  # pylint: disable=import-outside-toplevel
    loaded = _loaded_module(module)
    owners = {module, getattr(loaded, "__file__", None), sys.argv[0]
              if loaded is sys.modules.get("__main__") else None} - {None}
    for owner in owners:
        for flag in list(flags.FLAGS.flags_by_module_dict().get(owner, [])):  # (a copy: edited)
            if flag.name in flags.FLAGS:
                delattr(flags.FLAGS, flag.name)
    flags.FLAGS.unparse_flags()


def _jax_backend_started() -> bool:
    """Whether jax has started a backend in this process (forked, its devices would be the
    parent's); unknown counts as started."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is None:
        return False
    backends = getattr(bridge, "_backends", None)
    return backends is None or bool(backends)
