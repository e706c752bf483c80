"""Every numeric field of every registered experiment, set to 0, -1, NaN, a huge value and 1.5
through the command line's own parsing: a clean start or a ``TitanaxError`` naming the field --
never another exception, a hang or a silent acceptance of what cannot work.

"A clean start" is everything the launcher checks before jax touches a device: the overrides
parsed and type-checked, the evalers' inputs and an unset vocabulary completed from the train
input, ``validate()`` of the whole tree, and what every input declares it holds against the
model's limits (``train/inputs.py``). Which probe values each field accepts is a claim of its
own, kept in ``tests/config/value_sweep.txt`` (one line per field: the values it starts with);
a check removed from a ``_validate_values`` hook makes a value start that the file says is
refused, and this test fails naming it. After a deliberate change, rewrite the file with
``TITANAX_WRITE_GOLDEN=1 python -m pytest tests/config/test_value_sweep.py`` and review its
diff.
"""

from __future__ import annotations

import collections
import os
from typing import Any, Dict, List, Tuple

from titanax import errors
from titanax.config import overrides as overrides_lib
from titanax.config import paths, registry, typecheck
from titanax.train.inputs import check_declarations, complete_from_train_input, model_limits

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "value_sweep.txt")
# What each kind of field is set to (as command-line text).
PROBES = {"int": ("0", "-1", "nan", "1" + "0" * 30),
          "float": ("0", "-1", "nan", "1e30", "1.5")}


def _numeric_kind(annotation) -> str:
    for member in typecheck.union_members(typecheck.strip_annotated(annotation)):
        member = typecheck.strip_annotated(member)
        if member is int:
            return "int"
        if member is float:
            return "float"
    return ""


def numeric_fields(cfg) -> List[Tuple[str, str]]:
    """``(path, "int" | "float")`` of every numeric leaf, elements of numeric tuples included
    (``mesh.shape[1]``), and of numeric fields left at None (``stride``)."""
    out = []
    for path, value in cfg.walk():
        if isinstance(value, bool):
            continue
        try:
            annotation = overrides_lib._annotation_at(cfg, paths.parse_path(path))  # pylint: disable=protected-access
        except errors.TitanaxError:
            continue
        if isinstance(value, (tuple, list)) and value and all(
                v is None or isinstance(v, (int, float)) and not isinstance(v, bool)
                for v in value):
            out += [(f"{path}[{i}]", "float" if isinstance(v, float) else "int")
                    for i, v in enumerate(value)]
        elif value is None or isinstance(value, (int, float)):
            kind = _numeric_kind(annotation)
            if kind:
                out.append((path, kind))
    return out


def _names_the_field(error_path: str, field: str) -> bool:
    """Whether an error's path is the field, or the tuple / list holding it."""
    error_path = error_path.split(": ")[0]
    if error_path.startswith("config."):
        error_path = error_path[len("config."):]
    return error_path == field or field.startswith(error_path + "[")


_LIMITS: Dict[str, Any] = {}


def _model_limits(model_cfg) -> Any:
    """``model_limits``, once per distinct model config: building the model is most of the
    sweep's time, and most probes leave the model's fields as they are."""
    key = repr(model_cfg)
    if key not in _LIMITS:
        _LIMITS[key] = model_limits(model_cfg)
    return _LIMITS[key]


def start(cfg, field: str, text: str) -> str:
    """"starts" or "refused" (the error names ``field``); anything else fails the test."""
    try:
        cfg = overrides_lib.apply_overrides(cfg, [overrides_lib.Override(path=field, text=text)])
        cfg = complete_from_train_input(cfg)
        cfg.validate()
        check_declarations(cfg, _model_limits(cfg.model))
    except errors.TitanaxError as e:
        problems = getattr(e, "problems", None) or [e]
        named = [p.path or "" for p in problems]
        assert any(_names_the_field(path, field) for path in named), (
            f"{field}={text}: refused, but the error names {named}, not the field:\n"
            f"{e.format()}")
        return "refused"
    except Exception as e:  # pylint: disable=broad-except
        raise AssertionError(f"{field}={text}: {type(e).__name__} instead of a TitanaxError "
                             f"naming the field: {e}") from e
    return "starts"


def sweep() -> Dict[str, Dict[str, Tuple[str, ...]]]:
    """``{field: {experiment: the probe values it starts with}}`` over every experiment."""
    registry.load_config_modules(list(registry.DEFAULT_CONFIG_MODULES))
    out: Dict[str, Dict[str, Tuple[str, ...]]] = collections.defaultdict(dict)
    for experiment in registry.experiments():
        if not experiment.module.startswith(registry.DEFAULT_CONFIG_MODULES):
            continue  # (Experiments other tests of this process registered.)
        base = experiment.factory()
        for field, kind in numeric_fields(base):
            started = tuple(text for text in PROBES[kind]
                            if start(base.clone(), field, text) == "starts")
            out[field][experiment.name] = started
    return out


def golden_lines(results: Dict[str, Dict[str, Tuple[str, ...]]]) -> List[str]:
    """One line per field: the probe values it starts with (the same in every experiment that
    has it), or one line per experiment where they differ."""
    lines = []
    for field in sorted(results):
        by_experiment = results[field]
        if len(set(by_experiment.values())) == 1:
            started = next(iter(by_experiment.values()))
            lines.append(f"{field}: {' '.join(started) or '-'}")
        else:
            lines += [f"{field} ({name}): {' '.join(started) or '-'}"
                      for name, started in sorted(by_experiment.items())]
    return lines


def test_every_numeric_field_starts_cleanly_or_is_refused_by_name():
    lines = golden_lines(sweep())
    if os.environ.get("TITANAX_WRITE_GOLDEN"):
        with open(GOLDEN, "w", encoding="utf-8") as f:
            f.write("# Probe values each numeric field starts with (tests/config/"
                    "test_value_sweep.py); '-': it refuses them all.\n")
            f.write("".join(line + "\n" for line in lines))
    with open(GOLDEN, encoding="utf-8") as f:
        want = [line.rstrip("\n") for line in f if not line.startswith("#")]
    now_started = sorted(set(lines) - set(want))
    gone = sorted(set(want) - set(lines))
    assert not now_started and not gone, (
        "the fields' accepted values changed (a check removed, or added?):\n"
        + "".join(f"  now:  {line}\n" for line in now_started)
        + "".join(f"  was:  {line}\n" for line in gone)
        + "review, then rewrite with TITANAX_WRITE_GOLDEN=1 (see the module docstring)")
