"""Data shipped with Titanax, named in configs as ``bundled:<name>/<file>`` (where it lies
depends on the installation, so a config -- and its golden dump -- names it this way)."""

import os

PREFIX = "bundled:"
DIRECTORY = os.path.dirname(os.path.abspath(__file__))


def resolve(path: str) -> str:
    """``path``, or for ``bundled:<rest>`` the file ``<rest>`` of the bundled data."""
    if isinstance(path, str) and path.startswith(PREFIX):
        return os.path.join(DIRECTORY, path[len(PREFIX):])
    return path
