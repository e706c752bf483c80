"""``--config_file=run.yaml``: overrides kept in a file, applied like ``--config.<path>=<value>``.

Teams keep runs in files. A YAML (or JSON) mapping of ``path: value`` entries, nested or dotted
(``plan: {zero: {stage: 3}}`` is ``plan.zero.stage: 3``), becomes the same ``Override`` objects the
command line makes, so a value is parsed and type-checked exactly as ``--config.plan.zero.stage=3``
would be and an error names the field. A mapping under a key that is a sub-config is descended
into; under any other field (a dict-typed one, e.g. ``plan.tensor_parallel.rules``) it is the
value. Entries apply in file order, before the command line's overrides (the command line wins).
"""

from __future__ import annotations

import json
import os
from typing import Any, List

from titanax import errors
from titanax.config.base import ConfigBase
from titanax.config.overrides import Override, config_dict_at, holds_config

_FLAG = "--config_file"


def read_overrides(path: str, cfg: ConfigBase) -> List[Override]:
    """The overrides a config file holds, checked against ``cfg``'s tree for nesting."""
    entries = _load(path)
    overrides: List[Override] = []
    _flatten(entries, prefix="", node=cfg.clone(), out=overrides)
    return overrides


def _load(path: str) -> Any:
    if not os.path.isfile(path):
        raise errors.LaunchFlagError(f"no such file: {path}", path=_FLAG,
                                     suggestion="give the path of a .yaml or .json file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        if path.endswith(".json"):  # Every JSON string is written as a string.
            entries = json.loads(text, object_hook=lambda d: {
                k: _Quoted(v) if isinstance(v, str) else v for k, v in d.items()})
        else:
            entries = _load_yaml(text)
    except Exception as e:  # pylint: disable=broad-except
        raise errors.LaunchFlagError(f"cannot read {path}: {str(e).splitlines()[0]}",
                                     path=_FLAG, suggestion="fix the file's syntax") from None
    if entries is None:
        return {}
    if not isinstance(entries, dict):
        raise errors.LaunchFlagError(
            f"{path} holds a {type(entries).__name__}, not a mapping of path: value entries",
            path=_FLAG, suggestion="write e.g. `max_steps: 100` or `plan: {zero: {stage: 3}}`")
    return entries


class _Quoted(str):
    """A string the file wrote as a string (quoted): it stays text, whatever it looks like."""


def _load_yaml(text: str) -> Any:
    """YAML, with quoted scalars marked: ``path: '1e-3'`` is text, ``lr: 1e-3`` a number (YAML
    1.1 reads that unquoted as a string; the command-line parser then makes it a float, as
    ``--config.lr=1e-3`` would), ``x: None`` is None as on the command line."""
    import yaml  # pylint: disable=import-outside-toplevel

    class Loader(yaml.SafeLoader):  # pylint: disable=too-many-ancestors
        pass

    def construct_str(loader, node):
        value = loader.construct_scalar(node)
        return _Quoted(value) if node.style in ("'", '"') else value

    Loader.add_constructor("tag:yaml.org,2002:str", construct_str)
    return yaml.load(text, Loader=Loader)  # nosec: a SafeLoader subclass


def _flatten(entries: dict, *, prefix: str, node: ConfigBase, out: List[Override]) -> None:
    for key, value in entries.items():
        key = str(key)
        if not prefix and key.startswith("config."):
            key = key[len("config."):]
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and config_dict_at(node, path):
            for entry, fields in value.items():  # evalers: {heldout: {every_n_steps: 5}}
                _flatten({f"[{str(entry)!r}]": fields}, prefix=path, node=node, out=out)
        elif isinstance(value, dict) and value and holds_config(node, path):
            _flatten(value, prefix=f"{path}.", node=node, out=out)
        else:
            out.append(Override(path=path, text=_as_text(value)))


def _as_text(value: Any) -> str:
    """The command-line text of a YAML value (what ``--config.path=<text>`` would say)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple, dict)):
        return repr(value)
    if isinstance(value, _Quoted):
        return repr(str(value))  # "None" or "1e-3" written quoted stays that text.
    return str(value)
