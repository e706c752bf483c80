"""A docs page run as a newcomer would: its ``bash`` blocks line by line (``python`` is this
interpreter; ``../examples/`` the repository's: a page runs in the checkout's ``scratch/``), its
``python`` blocks as scripts, in order, in a fresh folder; every command must exit 0 without a traceback. A ``python`` or ``yaml`` block whose
first line is ``# file: NAME`` is a file the page has you write (a module a command imports, a
task definition): it is written to NAME, not run; other ``yaml`` blocks are examples only."""

import os
import re
import shlex
import subprocess
import sys
from typing import List, Tuple

from tests import forked_python
from tests.environment import child_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def blocks(page: str) -> List[Tuple[str, str]]:
    with open(page, encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"```(bash|python|yaml)\n(.*?)\n```", text, flags=re.S)


def commands(script: str) -> List[str]:
    """A bash block's commands (continuation lines joined)."""
    return [c.strip() for c in script.replace("\\\n", " ").split("\n") if c.strip()]


def walk(page: str, folder, *, quick_backend: bool = False) -> List[Tuple[str, str]]:
    """``[(command, stdout)]`` after running the whole page in ``folder``; ``quick_backend``:
    its commands compile without LLVM's optimisations (a page of evaluations and short runs,
    where compiling dominates: tests/environment.py)."""
    env = child_environment(quick_backend=quick_backend)
    outputs = []
    for kind, body in blocks(page):
        named = re.match(r"# file: (\S+)\n", body)
        if named:  # (A yaml block is always a file the page has you write.)
            target = folder / named.group(1)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(body)
            continue
        if kind == "yaml":
            continue
        if kind == "python":
            script = folder / f"snippet_{len(outputs)}.py"
            script.write_text(body)
            argv_list = [[sys.executable, str(script)]]
        else:
            argv_list = []
            for command in commands(body):
                assert command.startswith("python "), command
                # (The pages run in the checkout's scratch/: ../examples/ is the checkout's.)
                command = command.replace("../examples/", os.path.join(REPO_ROOT, "examples/"))
                argv_list.append(["bash", "-c", f"{sys.executable} {command[len('python '):]}"])
        for argv in argv_list:
            result = _run(argv, folder=folder, env=env)
            assert result.returncode == 0, (argv, result.stdout[-3000:], result.stderr[-3000:])
            assert "Traceback" not in result.stderr, result.stderr[-3000:]
            outputs.append((" ".join(argv), result.stdout))
    return outputs


def _run(argv: List[str], *, folder, env) -> subprocess.CompletedProcess:
    """``argv`` run in ``folder``; a ``bash -c "python ..."`` line without anything for the
    shell to do (no pipe, redirection, variable or quoting beyond words) forked from the
    preloaded interpreter (tests/forked_python.py), as bash would have run it."""
    if argv[0] == sys.executable:
        return forked_python.run(argv[1:], cwd=folder, env=env, timeout=600)
    line = argv[-1]
    if not re.search(r"[|&;<>$`*?~(){}\\!#]", line):
        words = shlex.split(line)
        if words[0] == sys.executable:
            return forked_python.run(words[1:], cwd=folder, env=env, timeout=600)
    return subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True,
                          timeout=600, check=False)


def output(outputs, fragment) -> List[str]:
    found = [out for command, out in outputs if fragment in command]
    assert found, f"no command with {fragment!r}"
    return found
