"""Golden dumps: ``tests/golden/<experiment>.txt`` holds ``debug_string()`` of every experiment.

A change to a default anywhere in the tree shows up as a diff in review instead of as a silently
different training run. The test compares; this module also regenerates:

    python -m titanax.config.golden --update          # rewrite tests/golden/*.txt
    python -m titanax.config.golden                   # check, print diffs, exit 1 on any
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Dict, List, Sequence

from titanax.config import registry

DEFAULT_GOLDEN_DIR = os.path.join("tests", "golden")


def expected_dumps(config_modules: Sequence[str] = registry.DEFAULT_CONFIG_MODULES) -> Dict[str, str]:
    """``{experiment name: debug_string()}`` for every experiment registered by those modules."""
    registry.load_config_modules(config_modules)
    return {e.name: registry.get_config(e.name).debug_string() for e in registry.experiments()
            if any(e.module == m or e.module.startswith(m + ".") for m in config_modules)}


def golden_problems(golden_dir: str, dumps: Dict[str, str]) -> List[str]:
    """Human-readable differences between ``golden_dir`` and ``dumps`` (empty when equal)."""
    problems = []
    for name, text in dumps.items():
        path = os.path.join(golden_dir, f"{name}.txt")
        if not os.path.exists(path):
            problems.append(f"{path}: missing (experiment {name!r} has no golden dump)")
            continue
        with open(path, encoding="utf-8") as f:
            golden = f.read()
        if golden != text:
            diff = difflib.unified_diff(golden.splitlines(keepends=True),
                                        text.splitlines(keepends=True),
                                        fromfile=f"{path} (golden)", tofile=f"{name} (now)")
            problems.append("".join(diff))
    if os.path.isdir(golden_dir):
        for file_name in sorted(os.listdir(golden_dir)):
            if file_name.endswith(".txt") and file_name[:-4] not in dumps:
                problems.append(f"{os.path.join(golden_dir, file_name)}: stale (no experiment "
                                f"named {file_name[:-4]!r} is registered)")
    if problems:
        problems.append("if these changes are intended, run: python -m titanax.config.golden "
                        "--update")
    return problems


def write_goldens(golden_dir: str, dumps: Dict[str, str]) -> None:
    os.makedirs(golden_dir, exist_ok=True)
    for file_name in os.listdir(golden_dir):
        if file_name.endswith(".txt") and file_name[:-4] not in dumps:
            os.remove(os.path.join(golden_dir, file_name))
    for name, text in dumps.items():
        with open(os.path.join(golden_dir, f"{name}.txt"), "w", encoding="utf-8") as f:
            f.write(text)


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite the golden files")
    parser.add_argument("--golden_dir", default=DEFAULT_GOLDEN_DIR)
    parser.add_argument("--config_module", action="append", default=None,
                        help="modules with experiments (default: the built-in titanax_experiments)")
    args = parser.parse_args(argv)
    dumps = expected_dumps(args.config_module or registry.DEFAULT_CONFIG_MODULES)
    if args.update:
        write_goldens(args.golden_dir, dumps)
        print(f"wrote {len(dumps)} golden dumps to {args.golden_dir}")
        return 0
    problems = golden_problems(args.golden_dir, dumps)
    print("\n".join(problems) if problems else f"{len(dumps)} golden dumps match")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
