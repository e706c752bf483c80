"""Config paths: ``model.decoder.layers[0].dim`` and ``plan.tensor_parallel.rules['attn/*']``.

A path is a dotted list of field names, with ``[i]`` to index a list or tuple and ``['key']`` to
index a dict. Paths are what errors print, what ``--config.a.b=value`` overrides name, and what
``get_recursively`` / ``set_recursively`` accept, so one parser serves all three.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import List, Sequence, Union

from titanax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Key:
    """A dict key inside a path (as opposed to a field name)."""

    value: object


PathToken = Union[str, int, Key]


def parse_path(path: Union[str, Sequence[PathToken]]) -> List[PathToken]:
    """Parses ``'a.b[0]["k"]'`` into ``['a', 'b', 0, Key('k')]``; token lists pass through."""
    if not isinstance(path, str):
        return list(path)
    tokens: List[PathToken] = []
    position = 0
    name = ""
    while position < len(path):
        char = path[position]
        if char == ".":
            if name:
                tokens.append(name)
            elif not tokens or position == 0:
                raise ConfigError("empty field name in path", path=path or "<empty>",
                                  suggestion="write paths like model.decoder.num_heads")
            name = ""
            position += 1
        elif char == "[":
            if name:
                tokens.append(name)
                name = ""
            end = path.find("]", position)
            if end < 0:
                raise ConfigError("unclosed '[' in path", path=path)
            tokens.append(_parse_subscript(path[position + 1:end], path))
            position = end + 1
        else:
            name += char
            position += 1
    if name:
        tokens.append(name)
    if not tokens:
        raise ConfigError("empty path", path="<empty>",
                          suggestion="write paths like model.decoder.num_heads")
    for token in tokens:
        if isinstance(token, str) and not token.isidentifier():
            raise ConfigError(f"{token!r} is not a valid field name", path=path)
    return tokens


def _parse_subscript(text: str, path: str) -> PathToken:
    text = text.strip()
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text  # An unquoted dict key: rules[attn/qkv].
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, (str, float, tuple, bool)) or value is None:
        return Key(value)
    raise ConfigError(f"cannot use {text!r} as a subscript", path=path)


def format_path(tokens: Sequence[PathToken]) -> str:
    out = ""
    for token in tokens:
        if isinstance(token, Key):
            out += f"[{token.value!r}]"
        elif isinstance(token, int):
            out += f"[{token}]"
        else:
            out += f".{token}" if out else token
    return out


def join_path(prefix: str, token: PathToken) -> str:
    """Appends one token to an already formatted path."""
    if isinstance(token, Key):
        return f"{prefix}[{token.value!r}]"
    if isinstance(token, int):
        return f"{prefix}[{token}]"
    return f"{prefix}.{token}" if prefix else token
