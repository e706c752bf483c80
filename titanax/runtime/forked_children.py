"""A local job's processes forked from its launcher instead of started as new interpreters.

The launcher of ``--local_processes=N`` has imported what each of its N children imports first
(jax, optax, Orbax, grain, Titanax and its experiments: ~3 s of CPU per process, measured on
2 cores) and has not started jax's backend, which reads the device count and ``XLA_FLAGS`` only
when it starts. So a child can be this process, forked: it takes its own session, signal
handlers, environment, output pipe and command line, forgets the module's flags and absl's
one-time set-up, then runs the launcher's module afresh as ``__main__`` -- the code ``python -u
-m module`` would run, on the imports already made.

What a child shares with its launcher, unlike a new interpreter: the open file descriptors
(``subprocess.Popen`` closes them), the hash seed and the warnings already shown. Per-process
state of Titanax's own modules starts anew at a fork (``os.register_at_fork``: the goodput clock,
a stop request recorded before training); numpy's global generator is reseeded here.

Forking is chosen only where it is safe: on POSIX, while this process runs one Python thread
(the native thread pool of OpenBLAS handles a fork itself) and jax has no backend, for a command
``[python, -u, -m, module, ...]`` whose module this process has imported. Everything else starts
new interpreters (``subprocess.Popen``) as before -- and so does a job given GPUs, where forking
has not been tried (no GPU where it was written).
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

# Signals the launcher handles itself (it forwards them to its children): blocked while a child
# is forked, so none reaches the child before it has a new interpreter's handlers.
_LAUNCHER_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


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
    kill, returncode), for a child forked by ``start``. As Popen's: a poll from a signal handler
    while another is reaping the child answers None, and a child reaped elsewhere counts as 0."""

    def __init__(self, pid: int, stdout: io.TextIOBase):
        self.pid = pid
        self.stdout = stdout
        self.returncode: Optional[int] = None
        self._reaping = threading.Lock()

    def poll(self) -> Optional[int]:
        return self._reap(blocking=False)

    def wait(self) -> int:
        while self.returncode is None:
            self._reap(blocking=True)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # (Reaped meanwhile.)
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _reap(self, *, blocking: bool) -> Optional[int]:
        if self.returncode is not None or not self._reaping.acquire(blocking=False):
            return self.returncode
        try:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, 0 if blocking else os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            self.returncode = 0
        finally:
            self._reaping.release()
        return self.returncode


def start(module: str, args: Sequence[str], *, env: Dict[str, str],
          siblings: Sequence[object] = ()) -> ForkedChild:
    """Forks a child that runs ``python -u -m module *args`` in ``env``, its stdout and stderr
    one text pipe (``.stdout``) as ``Popen(..., stdout=PIPE, stderr=STDOUT, text=True,
    start_new_session=True)`` gives. ``siblings``: the children started before (each with a
    ``.stdout``), whose pipes the child closes."""
    read_end, write_end = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # (Nothing buffered is written twice.)
        stream.flush()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _LAUNCHER_SIGNALS)
    try:
        pid = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        os.close(read_end)
        os.close(write_end)
        raise
    if pid == 0:
        try:  # Whatever happens, the child never returns into the launcher's code.
            os.close(read_end)
            for sibling in siblings:
                sibling.stdout.close()
            _become(module, list(args), env=env, output=write_end, signal_mask=blocked)
        finally:
            os._exit(1)  # pylint: disable=protected-access
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    os.close(write_end)
    return ForkedChild(pid, os.fdopen(read_end, "r", errors="replace", buffering=1))


def _become(module: str, args: Sequence[str], *, env: Dict[str, str], output: int,
            signal_mask) -> None:
    """The child's side: becomes ``python -u -m module *args``; never returns."""
    os.setsid()
    # A new interpreter's handlers, then the signals a new interpreter would have received.
    for sig, handler in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGHUP, signal.SIG_DFL),
                         (signal.SIGINT, signal.default_int_handler)):
        signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, signal_mask)
    code, killed_by = 1, None
    try:
        _redirect_output(output)
        os.environ.clear()
        os.environ.update(env)
        if "numpy" in sys.modules:  # (Seeded from the OS, as in a new interpreter.)
            sys.modules["numpy"].random.seed()
        path = _loaded_module(module).__file__
        _forget_flags_of(module)
        # runpy runs a fresh copy; the launcher's (its flags' values in its globals) goes.
        sys.modules.pop(module, None)
        sys.argv = [path, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = exit_code(e.code)
    except KeyboardInterrupt:  # As the interpreter: the traceback, then death by SIGINT.
        traceback.print_exc()
        killed_by = signal.SIGINT
    except BaseException:  # pylint: disable=broad-except
        traceback.print_exc()
    exit_like_the_interpreter(code, killed_by=killed_by)


def _redirect_output(output: int) -> None:
    """stdout and stderr to the pipe ``output``, unbuffered like ``python -u``: each line
    reaches the launcher as it is printed."""
    for fd in (1, 2):
        os.dup2(output, fd)
    os.close(output)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        open(1, "wb", buffering=0, closefd=False),  # pylint: disable=consider-using-with
        write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        open(2, "wb", buffering=0, closefd=False),  # pylint: disable=consider-using-with
        errors="backslashreplace", write_through=True)


def exit_code(code: object) -> int:
    """The exit status of ``SystemExit(code)``, as the interpreter makes it (a message is
    printed to stderr, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_like_the_interpreter(code: int, *, killed_by: Optional[int] = None) -> None:
    """Ends a forked process as the interpreter ends one: waits for its non-daemon threads, runs
    the exit handlers (those registered before the fork too, as a new interpreter that imported
    the same modules would have them), flushes its streams, then leaves with ``code`` (modulo
    256, as the operating system keeps it) -- or dies by the signal ``killed_by`` (an uncaught
    KeyboardInterrupt: SIGINT). Objects are not finalised; never returns."""
    try:
        threading._shutdown()  # pylint: disable=protected-access
        atexit._run_exitfuncs()  # pylint: disable=protected-access
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        if killed_by is not None:
            signal.signal(killed_by, signal.SIG_DFL)
            os.kill(os.getpid(), killed_by)
        os._exit(code % 256)  # pylint: disable=protected-access


def _loaded_module(module: str):
    """The module as this process imported it: by its name, or as ``__main__``."""
    if module in sys.modules:
        return sys.modules[module]
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return main if spec is not None and spec.name == module else None


def _forget_flags_of(module: str) -> None:
    """Removes the absl flags ``module`` defined (its fresh run defines them again), returns
    every other flag to its default, unparsed (the child's command line is parsed anew), and
    forgets absl's one-time set-up (``app.run`` does it again: help flags, verbosity)."""
    if "absl.flags" not in sys.modules:
        return
    from absl import app, flags  # pylint: disable=import-outside-toplevel
    loaded = _loaded_module(module)
    owners = {module, getattr(loaded, "__file__", None), sys.argv[0]
              if loaded is sys.modules.get("__main__") else None} - {None}
    for owner in owners:
        for flag in list(flags.FLAGS.flags_by_module_dict().get(owner, [])):  # (a copy: edited)
            if flag.name in flags.FLAGS:
                delattr(flags.FLAGS, flag.name)
    flags.FLAGS.unparse_flags()
    for once in (getattr(app, "_run_init", None),
                 getattr(app, "_register_and_parse_flags_with_usage", None)):
        if once is not None and hasattr(once, "done"):
            once.done = False


def _jax_backend_started() -> bool:
    """Whether jax has started a backend in this process (forked, its devices would be the
    parent's); unknown counts as started."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is None:
        return False
    backends = getattr(bridge, "_backends", None)
    return backends is None or bool(backends)
