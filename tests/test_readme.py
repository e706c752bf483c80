"""The README's set-up commands are the ones CI runs."""

import os
import re

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_commands():
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", setup, flags=re.S)


def test_readme_opens_with_two_setup_commands():
    commands = _readme_commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands)
    assert "titanax.launch" in commands[0] and "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    with open(os.path.join(REPO_ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci_lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert _readme_commands()[1] in ci_lines
