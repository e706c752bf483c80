"""Config trees back from their JSON record (``Config.to_json()``; a run's ``config.json``).

A record names the class of every config (``klass``) and the function of every function config
(``fn``) by import path, so the tree it describes can be rebuilt: each config starts from its
class's defaults and every recorded field is assigned through the usual type-checked setattr
(JSON lists become tuples where the field is a tuple). A field the class no longer has, or a path
that no longer imports, is a ``ConfigError`` naming it -- except the fields retired on purpose
(``RETIRED_FIELDS``: the per-layer parallel axes the axis binding replaced), which are dropped and
handed back to the caller (``retired``) to carry over where they live now. Used by commands that act on a finished
run (``python -m titanax.export``, ``python -m titanax.generate``).
"""

from __future__ import annotations

import importlib
import typing
from typing import Any, Dict, Optional

from titanax import errors
from titanax.config.base import ConfigBase, _resolve_annotations
from titanax.config.configurable import config_for_function


# Fields earlier versions recorded on layer configs, retired when layers began to ask the run's
# axis binding for their mesh axes (parallel/axis_binding.py): the plan says all of it now.
RETIRED_FIELDS = {
    "tp_axis": "plan.tensor_parallel.axis",
    "sequence_parallel": "plan.tensor_parallel.sequence_parallel",
    "cp_axis": "plan.context_parallel.axis",
    "cp_strategy": "plan.context_parallel.strategy",
    "ep_axis": "plan.expert_parallel.axis",
}


# Configurable classes earlier versions recorded that are now configurations of another one:
# recorded class -> the function giving the config that replaces it (its fields keep their
# names). GPT-2 became a configuration of the decoder family.
RETIRED_CLASSES = {
    "titanax.modules.models.gpt.GPT": "titanax.modules.models.decoder.gpt_config",
}


# Configurable classes that moved: recorded import path -> where the class is now (its fields
# keep their names). Wave 5 made the objectives plug-ins (titanax/objectives/).
MOVED_CLASSES = {
    "titanax.modules.preference.Preference": "titanax.objectives.preference.Preference",
    "titanax.rl.grpo.GRPO": "titanax.objectives.grpo.GRPO",
}

# Fields a run's record held before wave 5 that live under its ``objective`` now: the objective
# itself (``preference`` / ``grpo``) and the reference model's directory.
OBJECTIVE_FIELDS = ("preference", "grpo")


def _objective_moved_in(data: Dict[str, Any]) -> Dict[str, Any]:
    """An Engine record written before wave 5, its objective fields under ``objective``."""
    if "objective" in data or not any(k in data for k in OBJECTIVE_FIELDS) or \
            not str(data.get("klass", "")).endswith(".Engine"):
        return data  # (An Engine record of then holds both, None where unused.)
    data = dict(data)
    objective = next((data[k] for k in OBJECTIVE_FIELDS if data.get(k) is not None), None)
    reference = data.pop("reference_from", None)
    for name in OBJECTIVE_FIELDS:
        data.pop(name, None)
    if objective is not None:
        data["objective"] = dict(objective, **({"reference_from": reference}
                                               if reference is not None else {}))
    return data


def config_from_json(data: Dict[str, Any], *, path: str = "config",
                     retired: Optional[Dict[str, Any]] = None) -> ConfigBase:
    """The config tree of ``data`` (a dict with a ``klass`` or ``fn`` entry). ``retired``
    (optional) receives ``{path: value}`` of every retired field the record held."""
    data = _objective_moved_in(data)
    if data.get("klass") in MOVED_CLASSES:
        data = dict(data, klass=MOVED_CLASSES[data["klass"]])
    if "klass" in data and data["klass"] in RETIRED_CLASSES:
        cfg = _imported(RETIRED_CLASSES[data["klass"]], path=f"{path}.klass")()
        skip = "klass"
    elif "klass" in data:
        cfg = _imported(data["klass"], path=f"{path}.klass").default_config()
        skip = "klass"
    elif "fn" in data:
        cfg = config_for_function(_imported(data["fn"], path=f"{path}.fn"))
        skip = "fn"
    else:
        raise errors.ConfigError("a recorded config names neither its klass nor its fn",
                                 path=path, suggestion="give the config.json a run wrote")
    fields = type(cfg).__fields__
    annotations = _resolve_annotations(type(cfg))
    for name, value in data.items():
        if name == skip:
            continue
        if name not in fields and name in RETIRED_FIELDS:
            if retired is not None:
                retired[f"{path}.{name}"] = value
            continue
        if name not in fields:
            raise errors.ConfigError(f"{type(cfg).__qualname__} has no field {name!r}",
                                     path=f"{path}.{name}",
                                     suggestion="the record was written by another version of "
                                                "the code: edit it or re-run")
        setattr(cfg, name, _value(value, annotations.get(name), path=f"{path}.{name}",
                                  retired=retired))
    return cfg


# How the record writes floats JSON has no number for (formatting.json_value).
NON_FINITE = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}


def _value(value: Any, annotation: Any, *, path: str,
           retired: Optional[Dict[str, Any]] = None) -> Any:
    if isinstance(value, str) and value in NON_FINITE and _admits_float(annotation):
        return NON_FINITE[value]
    if isinstance(value, dict) and ("klass" in value or "fn" in value):
        return config_from_json(value, path=path, retired=retired)
    if isinstance(value, dict):
        return {k: _value(v, None, path=f"{path}[{k!r}]", retired=retired)
                for k, v in value.items()}
    if isinstance(value, list):
        items = [_value(v, None, path=f"{path}[{i}]", retired=retired)
                 for i, v in enumerate(value)]
        return items if _is_list(annotation) else tuple(items)
    return value


def _admits_float(annotation: Any) -> bool:
    if annotation is float:
        return True
    if typing.get_origin(annotation) is typing.Union:
        return any(_admits_float(a) for a in typing.get_args(annotation))
    return False


def _is_list(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        return any(_is_list(a) for a in typing.get_args(annotation) if a is not type(None))
    return annotation is list or origin is list


def _imported(dotted: str, *, path: str) -> Any:
    module_name, _, name = str(dotted).rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise errors.ConfigError(f"cannot import {dotted!r}: {e}", path=path,
                                 suggestion="the record was written by another version of the "
                                            "code, or names a module not on sys.path") from e
