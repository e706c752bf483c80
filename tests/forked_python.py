"""The Python commands tests start (``python -m titanax.launch ...``), forked from a process that
has already imported the heavy libraries they all import.

Every child a test starts spends ~1.2 s of CPU importing jax, grain, optax, Orbax and numpy
before it reads its first flag (measured: a 2-step ``llama_tiny_dp_tp`` launch, compilation cache
warm, 5.8 s of CPU as ``python -m`` and 4.6 s forked from such a process), and the suite starts
hundreds. So each test process keeps one server (``python -m tests.forked_python SOCKET``): it
imports those libraries and Titanax's experiments (below) -- nothing that starts jax's backend,
which reads ``XLA_FLAGS`` and the device count only when it starts -- and forks a child per
command. The child takes the command's working directory, environment, ``sys.argv`` and
``sys.path`` and its own output files, then runs the module as ``__main__`` the way ``python -m``
does, and exits with its status.

What the libraries read from the environment when they are imported (``JAX_*``: jax's config
defaults; the thread counts of OpenBLAS / OpenMP) is fixed in the server: a command whose
environment differs there runs as a plain subprocess -- but for ``JAX_ENABLE_X64``, which the
forked command sets in jax's config itself before its code runs. So does anything not started
through ``run``: tests that signal or kill their child (SIGTERM, kill -9) start real processes.
"""

from __future__ import annotations

import ast
import atexit
import importlib
import importlib.util
import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from typing import Dict, List, Optional, Sequence

from titanax.runtime import forked_children

# Imported once by the server: what (nearly) every command imports before its own code runs.
PRELOADED = ("numpy", "jax", "jax.numpy", "jax.experimental.shard_map", "optax",
             "orbax.checkpoint", "grain", "absl.app", "absl.flags", "absl.logging",
             "ml_collections", "yaml", "tensorboardX")
# ... and Titanax: all its experiments' package imports (~0.5 s of CPU per command; the package
# itself is imported afresh by each command) -- not the commands' own modules (``titanax.launch``,
# ``titanax.export``, ...), which define their flags when they run as ``__main__``; nothing
# Titanax imports starts jax's backend, and its one per-process state, the goodput clock, starts
# anew in a forked child (``titanax/observe/goodput.py``).
PRELOADED_PACKAGE = "titanax_experiments"
# Environment variables read when those libraries are imported: a command with other values
# than the server's runs as a plain subprocess.
_READ_AT_IMPORT = ("JAX_", "TF_", "OMP_", "OPENBLAS_", "MKL_", "GRAIN_", "TENSORSTORE_",
                   "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS",
                   "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONFAULTHANDLER", "PYTHONHOME",
                   "PYTHONNOUSERSITE", "PYTHONSAFEPATH", "PYTHONOPTIMIZE")


# ... except those a forked command sets itself through jax's config (its default otherwise).
_SET_AFTER_FORK = {"JAX_ENABLE_X64": ("jax_enable_x64", False)}


def _import_time_environment(env: Dict[str, str]) -> Dict[str, str]:
    return {k: v for k, v in env.items()
            if k.startswith(_READ_AT_IMPORT) and k not in _SET_AFTER_FORK}


def _set_after_fork(env: Dict[str, str]) -> None:
    import jax  # pylint: disable=import-outside-toplevel
    for variable, (option, default) in _SET_AFTER_FORK.items():
        value = env.get(variable)
        jax.config.update(option, default if value is None else
                          value.strip().lower() in ("1", "true", "t", "yes", "y", "on"))


# --- The test's side ---------------------------------------------------------------------------

class _Server:
    """This process's server: started at the first command, stopped when this process ends."""

    def __init__(self):
        self._folder = tempfile.mkdtemp(prefix="titanax-forked-python-")
        self.socket_path = os.path.join(self._folder, "socket")
        self.environment = dict(os.environ)
        self._process = subprocess.Popen(  # pylint: disable=consider-using-with
            [sys.executable, "-m", "tests.forked_python", self.socket_path],
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            env=self.environment, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        ready = self._process.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"tests.forked_python server did not start: {ready!r}")
        atexit.register(self.stop)

    def alive(self) -> bool:
        return self._process.poll() is None

    def serves(self, env: Dict[str, str]) -> bool:
        return (_import_time_environment(env)
                == _import_time_environment(self.environment))

    def stop(self) -> None:
        if self.alive():
            self._process.kill()
            self._process.wait()


_SERVER: Optional[_Server] = None


def _server() -> _Server:
    global _SERVER  # pylint: disable=global-statement
    if _SERVER is None or not _SERVER.alive():
        _SERVER = _Server()
    return _SERVER


def run(args: Sequence[str], *, cwd: Optional[str] = None, env: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None, input: Optional[str] = None  # pylint: disable=redefined-builtin
        ) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], cwd=, env=, input=, capture_output=True,
    text=True, timeout=, check=False)``, forked from the server when ``env`` allows (above).
    ``args``: ``["-m", module, *flags]`` or ``[script, *flags]``."""
    cwd = os.getcwd() if cwd is None else str(cwd)
    env = dict(os.environ) if env is None else env
    # Two checks: against this process's environment first, so that a test whose commands all
    # run plain starts no server; then against the server's, which was fixed when it started --
    # this process's may have changed since (a test's monkeypatch.setenv).
    plain = _import_time_environment(env) != _import_time_environment(dict(os.environ))
    server = None if plain else _server()
    if plain or not server.serves(env):
        return subprocess.run([sys.executable, *args], cwd=cwd, env=env, input=input,
                              capture_output=True, text=True, timeout=timeout, check=False)
    with tempfile.TemporaryDirectory(prefix="titanax-forked-run-") as folder:
        request = {"args": list(args), "cwd": os.path.abspath(cwd), "env": dict(env),
                   "stdin": None, "stdout": os.path.join(folder, "stdout"),
                   "stderr": os.path.join(folder, "stderr")}
        if input is not None:
            request["stdin"] = os.path.join(folder, "stdin")
            with open(request["stdin"], "w", encoding="utf-8") as f:
                f.write(input)
        returncode = _ask(server.socket_path, request, timeout=timeout, args=args)
        outputs = []
        for name in ("stdout", "stderr"):
            with open(request[name], encoding="utf-8", errors="replace") as f:
                outputs.append(f.read())
    return subprocess.CompletedProcess([sys.executable, *args], returncode, *outputs)


def _ask(socket_path: str, request: Dict[str, object], *, timeout: float,
         args: Sequence[str]) -> int:
    """The command's exit status; past ``timeout`` the command is killed (the server's handler
    sees the connection close) and ``subprocess.TimeoutExpired`` raised, as subprocess.run does."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(socket_path)
        connection.sendall(json.dumps(request).encode() + b"\n")
        connection.settimeout(timeout)
        try:
            answer = _read_line(connection)
        except socket.timeout as e:
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout) from e
    return int(json.loads(answer)["returncode"])


def _read_line(connection: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(65536)
        if not chunk:
            raise RuntimeError("tests.forked_python: the server's handler closed the connection "
                               f"without an exit status (got {data!r})")
        data += chunk
    return data


# --- The server's side -------------------------------------------------------------------------

def serve(socket_path: str) -> None:
    """Imports PRELOADED, then forks a handler per connection until the test process ends."""
    for name in PRELOADED:
        importlib.import_module(name)
    _import_package(PRELOADED_PACKAGE)
    parent = os.getppid()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # (Handlers are reaped by the kernel.)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    listener.settimeout(1.0)
    print("ready", flush=True)
    while os.getppid() == parent:
        try:
            connection, _ = listener.accept()
        except socket.timeout:
            continue
        if os.fork() == 0:
            listener.close()
            _handle(connection)
        connection.close()


def _import_package(name: str) -> None:
    """Imports the Titanax modules the package's modules import at their top -- read from their
    source, not by importing them: a command imports the package itself afresh (it is small), so
    its experiments register in the command alone, and one that imports the checkout's
    ``experiments`` folder under that name (an example script) registers them under that name
    alone, as it would in a process of its own."""
    folders = importlib.util.find_spec(name).submodule_search_locations
    for folder in folders:
        for root, _, files in os.walk(folder):
            for file in sorted(f for f in files if f.endswith(".py")):
                with open(os.path.join(root, file), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                for module in _titanax_imports(tree):
                    importlib.import_module(module)


def _titanax_imports(tree: ast.Module) -> List[str]:
    """The ``titanax`` modules a module's top-level statements import (``from titanax.x import
    y`` names ``titanax.x.y`` too when that is a module)."""
    modules = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            modules += [a.name for a in node.names if a.name.split(".")[0] == "titanax"]
        elif (isinstance(node, ast.ImportFrom) and not node.level and node.module
              and node.module.split(".")[0] == "titanax"):
            modules.append(node.module)
            if importlib.util.find_spec(node.module).submodule_search_locations:  # a package
                modules += [f"{node.module}.{a.name}" for a in node.names
                            if importlib.util.find_spec(f"{node.module}.{a.name}") is not None]
    return modules


def _handle(connection: socket.socket) -> None:
    """One command: forks it, waits for it (killing its process group if the test stops
    waiting), sends its exit status back. Never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    code = 1
    try:
        request = json.loads(_read_line(connection))
        pid = os.fork()
        if pid == 0:
            connection.close()
            _become(request)
        code = _wait(pid, connection)
        connection.sendall(json.dumps({"returncode": code}).encode() + b"\n")
    finally:
        os._exit(0)  # pylint: disable=protected-access


def _wait(pid: int, connection: socket.socket) -> int:
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        readable, _, _ = select.select([connection], [], [], 0.05)
        if readable and not connection.recv(1, socket.MSG_PEEK):  # The test stopped waiting.
            for target in (lambda: os.killpg(pid, signal.SIGKILL),
                           lambda: os.kill(pid, signal.SIGKILL)):
                try:
                    target()
                except OSError:
                    pass
            os.waitpid(pid, 0)
            os._exit(0)  # pylint: disable=protected-access


def _become(request: Dict[str, object]) -> None:
    """This process becomes ``python ARGS`` run in the request's folder and environment."""
    os.setpgid(0, 0)
    for number, handler in ((signal.SIGCHLD, signal.SIG_DFL), (signal.SIGTERM, signal.SIG_DFL),
                            (signal.SIGINT, signal.default_int_handler)):
        signal.signal(number, handler)
    env = request["env"]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)
    _redirect(request, unbuffered=bool(env.get("PYTHONUNBUFFERED")))
    _set_after_fork(env)
    args: List[str] = list(request["args"])
    if args[0] in ("-m", "-c"):  # (As the interpreter: its folder is the working directory.)
        sys.argv, first = [args[0], *args[2:]], request["cwd"]
    else:
        sys.argv, first = list(args), os.path.dirname(os.path.abspath(args[0]))
    sys.path[:] = _command_path(first, env)
    code = 0
    try:
        if args[0] == "-m":
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})  # pylint: disable=exec-used
        else:
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        code = forked_children.exit_code(e.code)
    except BaseException:  # pylint: disable=broad-except
        traceback.print_exc()
        code = 1
    forked_children.exit_like_the_interpreter(code)


def _redirect(request: Dict[str, object], *, unbuffered: bool) -> None:
    """Standard streams onto the request's files, as the interpreter opens them for pipes."""
    stdin = os.open(request["stdin"] or os.devnull, os.O_RDONLY)
    stdout = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    stderr = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False),
                                                 encoding="utf-8")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=unbuffered)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
        line_buffering=True)


def _command_path(first: str, env: Dict[str, str]) -> List[str]:
    """``sys.path`` as the interpreter builds it for the command: its folder (``-m``: the
    working directory; a script: the script's), then its ``PYTHONPATH``, then the
    installation's (the server's path without the server's own folder and PYTHONPATH)."""
    own = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    server_extra = {os.path.abspath(p) for p in _SERVER_PYTHONPATH}
    base = [p for p in sys.path[1:] if os.path.abspath(p) not in server_extra]
    return [first, *own, *base]


_SERVER_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]

if __name__ == "__main__":
    serve(sys.argv[1])
