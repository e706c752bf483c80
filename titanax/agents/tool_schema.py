"""A tool's JSON schema, read from its Python signature and its docstring -- what a chat
template renders into its ``tools`` so the model knows what it may call.

Why from the function: the user writes the tool once, as Python, and what the model is told
cannot drift from what the tool accepts. The schema has the layout chat templates expect (and
transformers' ``get_json_schema`` writes): ``{"type": "function", "function": {"name",
"description", "parameters": {"type": "object", "properties", "required"}, "return"}}``.

The docstring is Google style: a description, then ``Args:`` with ``name: description`` per
parameter (continued on indented lines), optionally ``Returns:``. A tool without a docstring,
a parameter without a description or a type, or a type JSON cannot carry, is refused by name:
the model would be told less than it needs, or the call could not be made from JSON.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from typing import Any, Callable, Dict, List, Tuple

from titanax import errors

# Python types and their JSON schema types.
_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean",
            type(None): "null", dict: "object", list: "array", tuple: "array"}
_SECTIONS = ("Args:", "Arguments:", "Returns:", "Return:", "Raises:", "Yields:", "Examples:",
             "Example:", "Notes:", "Note:")


def json_schema(function: Callable, *, where: str) -> Dict[str, Any]:
    """``function``'s schema (module docstring); ``where``: the config path naming it."""
    name = getattr(function, "__name__", repr(function))
    doc = inspect.getdoc(function)
    if not doc:
        raise errors.AgentError(f"tool {name!r} has no docstring: the model would not know "
                                f"what it does", path=where,
                                suggestion="describe it, and each argument under Args:")
    description, arguments, returns = _docstring_parts(doc)
    hints = typing.get_type_hints(function)
    properties, required = {}, []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise errors.AgentError(f"tool {name!r} takes *{parameter.name}: a call from JSON "
                                    f"names each argument", path=where,
                                    suggestion="give it named parameters")
        at = f"tool {name!r} argument {parameter.name!r}"
        if parameter.name not in hints:
            raise errors.AgentError(f"{at} has no type annotation", path=where,
                                    suggestion="annotate it (int, str, list[str], ...)")
        if parameter.name not in arguments:
            raise errors.AgentError(f"{at} is not described under Args: in its docstring",
                                    path=where, suggestion=f"add '{parameter.name}: ...'")
        properties[parameter.name] = {**_type_schema(hints[parameter.name], at=at, where=where),
                                      "description": arguments[parameter.name]}
        if parameter.default is inspect.Parameter.empty:
            required.append(parameter.name)
    schema = {"name": name, "description": description,
              "parameters": {"type": "object", "properties": properties, "required": required}}
    if "return" in hints:
        schema["return"] = _type_schema(hints["return"], at=f"tool {name!r}'s return",
                                        where=where)
        if returns:
            schema["return"]["description"] = returns
    return {"type": "function", "function": schema}


def _docstring_parts(doc: str) -> Tuple[str, Dict[str, str], str]:
    """``(description, {argument: description}, returns)`` of a Google-style docstring."""
    lines = doc.splitlines()
    sections: Dict[str, List[str]] = {"": []}
    current = ""
    for line in lines:
        if line.strip() in _SECTIONS and not line.startswith((" ", "\t")):
            current = line.strip().rstrip(":")
            sections[current] = []
        else:
            sections[current].append(line)
    description = "\n".join(sections[""]).strip()  # (Its lines as written, as transformers.)
    arguments = _arguments(sections.get("Args", sections.get("Arguments", [])))
    returns = " ".join(" ".join(sections.get("Returns", sections.get("Return", []))).split())
    return description, arguments, returns


def _arguments(lines: List[str]) -> Dict[str, str]:
    """``{name: description}`` of an ``Args:`` section: entries ``name: text`` (or ``name
    (type): text``) at the section's indentation, deeper lines continuing the one before."""
    entries = [line for line in lines if line.strip()]
    arguments: Dict[str, str] = {}
    last = None
    for line in entries:
        found = re.match(r"(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line.strip())
        if found and _indent(line) == _indent(entries[0]):
            last = found.group(1)
            arguments[last] = found.group(2).strip()
        elif last is not None:
            arguments[last] = f"{arguments[last]} {line.strip()}".strip()
    return arguments


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _type_schema(hint: Any, *, at: str, where: str) -> Dict[str, Any]:
    """The JSON schema of a Python type annotation (refused by name where JSON has none)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    if origin is typing.Literal:
        kinds = {_SCALARS.get(type(value)) for value in args}
        if None in kinds or len(kinds) != 1:
            raise errors.AgentError(f"{at}: Literal{list(args)} mixes types or holds a value "
                                    f"JSON cannot carry", path=where,
                                    suggestion="use Literal values of one type: str, int, ...")
        return {"type": kinds.pop(), "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:  # Optional[X]
            return {**_type_schema(members[0], at=at, where=where), "nullable": True}
        schemas = [_type_schema(a, at=at, where=where) for a in members]
        if any(set(s) != {"type"} for s in schemas):
            raise errors.AgentError(f"{at}: a union of {hint} is more than JSON types",
                                    path=where, suggestion="use a union of plain types")
        union = {"type": [s["type"] for s in schemas]}
        return {**union, "nullable": True} if len(members) < len(args) else union
    if origin in (list, tuple):
        if origin is tuple:
            raise errors.AgentError(f"{at}: a tuple's places have no JSON schema here",
                                    path=where, suggestion="use list[...]")
        return {"type": "array", **({"items": _type_schema(args[0], at=at, where=where)}
                                    if args else {})}
    if origin is dict:
        if args and args[0] is not str:
            raise errors.AgentError(f"{at}: a JSON object's keys are strings, not {args[0]}",
                                    path=where, suggestion="use dict[str, ...]")
        return {"type": "object", **({"additionalProperties": _type_schema(
            args[1], at=at, where=where)} if args else {})}
    raise errors.AgentError(f"{at} is annotated {hint!r}, which a call from JSON cannot "
                            f"build", path=where,
                            suggestion="use str, int, float, bool, list[...], dict, Literal, "
                                       "Optional")
