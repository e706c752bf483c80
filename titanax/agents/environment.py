"""The environment protocol of multi-turn RL, and the checks that hold a user's class to it.

A user names a class by import path (``objective.environment``); its constructor takes no
arguments, and it has

- ``reset(record) -> messages``: the opening chat messages (``{"role", "content"}`` dicts) for
  one prompt record (a dict of the data file's fields);
- ``step(messages) -> (new_messages, reward, done)``: called with the whole conversation after
  each assistant turn; returns the messages to append (role ``tool`` or ``user``), this turn's
  reward (a finite number) and whether the episode ends.

Why checked here: a class missing ``step`` must be refused by its config path before step 1,
and what only a call shows -- a step that returns two values, a reward of NaN -- must name the
environment and the record it was playing, not fail somewhere inside a rollout.
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Dict, List, Tuple

import numpy as np

from titanax import errors
from titanax.utils.import_path import import_object

# The roles an environment may answer with (the assistant's turns are the model's own).
ANSWER_ROLES = ("tool", "user")


def load_environment(path: str, *, where: str) -> Any:
    """An instance of the environment class at ``path`` (``where``: its config path), checked
    to have ``reset`` and ``step`` and a constructor of no arguments."""
    cls = import_object(path, where=where, what="class", error=errors.AgentError)
    if not inspect.isclass(cls):
        raise errors.AgentError(f"{path!r} is a {type(cls).__name__}, not a class", path=where,
                                suggestion="name a class with reset(record) and step(messages)")
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise errors.AgentError(f"{cls.__name__} has no method {method}()", path=where,
                                    suggestion="implement reset(record) -> messages and "
                                               "step(messages) -> (new_messages, reward, done)")
    try:
        return cls()
    except TypeError as e:
        raise errors.AgentError(f"{cls.__name__}() cannot be made without arguments ({e})",
                                path=where,
                                suggestion="give its constructor no required arguments") from None


def checked_messages(messages: Any, *, said_by: str, roles: Tuple[str, ...]) -> List[Dict]:
    """``messages`` if they are a list of ``{"role", "content"}`` dicts with string content
    and roles among ``roles``; else an ``AgentError`` naming ``said_by`` (the environment, the
    call and the record)."""
    if not isinstance(messages, list):
        raise errors.AgentError(f"{said_by} returned {type(messages).__name__}, not a list of "
                                f"messages", suggestion='return [{"role": ..., "content": ...}]')
    for index, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("content"), str)
                and message.get("role") in roles):
            raise errors.AgentError(
                f"{said_by}: message {index} is {message!r}; each is a dict with a role among "
                f"{', '.join(roles)} and string content",
                suggestion='return [{"role": "tool", "content": "..."}]')
    return messages


def checked_step(result: Any, *, said_by: str) -> Tuple[List[Dict], float, bool]:
    """``step``'s ``(new_messages, reward, done)``, checked (``said_by``: as in
    ``checked_messages``)."""
    if not (isinstance(result, tuple) and len(result) == 3):
        shown = f"{len(result)} values" if isinstance(result, (tuple, list)) else \
            type(result).__name__
        raise errors.AgentError(f"{said_by} returned {shown}; step returns (new_messages, "
                                f"reward, done)", suggestion="return a tuple of three")
    messages, reward, done = result
    messages = checked_messages(messages, said_by=said_by, roles=ANSWER_ROLES)
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or \
            not math.isfinite(reward):
        raise errors.AgentError(f"{said_by} returned the reward {reward!r}; a reward is a finite "
                                f"number", suggestion="return 0.0 for a turn that earns nothing")
    if not isinstance(done, (bool, np.bool_)):
        raise errors.AgentError(f"{said_by} returned done={done!r}; done is True or False",
                                suggestion="return a bool")
    return messages, float(reward), bool(done)
