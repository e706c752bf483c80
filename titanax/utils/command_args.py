"""Command lines handed on: a launcher passes its own arguments to the processes it starts or
the manifests it writes, less the flags it answers itself."""

from __future__ import annotations

from typing import List, Sequence


def without_flags(args: Sequence[str], names: Sequence[str]) -> List[str]:
    """``args`` minus the valued flags ``names`` (``--name=value`` or ``--name value``; one or
    two dashes): a launcher's command line handed on without what it answers itself."""
    kept, skip_value = [], False
    for arg in args:
        if skip_value:
            skip_value = False
            continue
        name = arg.split("=", 1)[0].lstrip("-")
        if arg.startswith("-") and name in names:
            skip_value = "=" not in arg
            continue
        kept.append(arg)
    return kept
