"""Every error Titanax raises on purpose.

A user who hits one of these should learn three things without reading our source: *where* the
problem is (a config path such as ``model.decoder.num_heads``, a param path, a mesh axis or a flag),
*what* is wrong, and *what to do*. So every error carries ``path``, ``message`` and ``suggestion``,
and each kind of problem has its own class so callers (and tests) can catch exactly what they mean.

This module imports nothing but the standard library: the config system, which must not import
jax, depends on it.
"""

from __future__ import annotations

from typing import Optional, Sequence


class TitanaxError(Exception):
    """Base class of all deliberate Titanax errors.

    Attributes:
        path: The thing that is wrong: a config path, param path, mesh axis or flag. May be None
            when the error is about the whole run.
        message: What is wrong, in one sentence.
        suggestion: What to do about it. May be None when there is nothing useful to add.
    """

    def __init__(self, message: str, *, path: Optional[str] = None,
                 suggestion: Optional[str] = None):
        self.path = path
        self.message = message
        self.suggestion = suggestion
        super().__init__(self.format())

    def format(self) -> str:
        text = f"{self.path}: {self.message}" if self.path else self.message
        if self.suggestion:
            text += f"\n  suggestion: {self.suggestion}"
        return text


# --- Config system -------------------------------------------------------------------------------

class ConfigError(TitanaxError):
    """A config tree, a config class or a config value is wrong."""


class UnknownFieldError(ConfigError):
    """A config path names a field that does not exist."""


class RequiredFieldError(ConfigError):
    """A field declared REQUIRED was never set."""


class ConfigTypeError(ConfigError):
    """A value does not match the type annotation of the field it is assigned to."""


class FrozenConfigError(ConfigError):
    """Someone tried to change a frozen config."""


class UnknownExperimentError(ConfigError):
    """A named experiment is not registered."""


class ConfigValidationError(ConfigError):
    """``validate()`` found one or more problems; all of them are listed, each with its path."""

    def __init__(self, problems: Sequence[TitanaxError], *, what: str = "config"):
        self.problems = list(problems)
        count = len(self.problems)
        lines = [f"{count} problem{'s' if count != 1 else ''} in the {what}:"]
        for problem in self.problems:
            lines.extend("  " + line for line in problem.format().splitlines())
        super().__init__("\n".join(lines))


# --- Launcher ------------------------------------------------------------------------------------

class LaunchFlagError(TitanaxError):
    """A command-line flag of ``python -m titanax.launch`` is missing, malformed or inconsistent."""


# --- Runtime and parallelism ---------------------------------------------------------------------

class MeshError(TitanaxError):
    """A mesh cannot be built from the devices at hand (shape, axis names, device list)."""


class DistributedError(TitanaxError):
    """The multi-process runtime could not start (rendezvous failed or timed out)."""


class PlanError(TitanaxError):
    """A parallel plan is inconsistent with itself, the mesh or the batch."""


class ShardingError(TitanaxError):
    """A PartitionSpec does not fit a param or batch, or no rule gives a param one."""


class CollectiveError(TitanaxError):
    """A collective was called outside shard_map, on a missing axis, or on unfit values."""


# --- Modules -------------------------------------------------------------------------------------

class ModuleError(TitanaxError):
    """A module was called without a context, from the wrong parent, or with mismatched params."""


# --- Training ------------------------------------------------------------------------------------

class StepError(TitanaxError):
    """A train step does not fit the plan (e.g. it never reduces gradients over the data axis)."""


class RecompileError(TitanaxError):
    """A compiled step was called with inputs of another shape or dtype than it was compiled for."""


class NonFiniteError(TitanaxError):
    """The loss (or the gradients) became NaN or infinite."""


class DataError(TitanaxError):
    """An input pipeline cannot produce what the run needs (missing files, bad batch sizes)."""


class MissingChatTemplateError(DataError):
    """Conversations asked of a tokenizer that ships no chat template, none configured."""


# --- Checkpoints ---------------------------------------------------------------------------------

class CheckpointError(TitanaxError):
    """A checkpoint cannot be written or read, or does not match the run restoring it."""


# --- Hugging Face model directories --------------------------------------------------------------

class HFError(TitanaxError):
    """A Hugging Face model directory (config.json, safetensors, tokenizer) cannot be read into
    Titanax, or a Titanax model cannot be written as one."""


class RewardError(TitanaxError):
    """A reward function that cannot be imported, or returned what a reward cannot be."""


class AgentError(TitanaxError):
    """An environment or tool of multi-turn RL that cannot be imported, described or called as
    its protocol says (titanax/agents): a class without ``step``, a tool without a docstring, a
    step that returns something else than ``(messages, reward, done)``."""


# --- Evaluation ----------------------------------------------------------------------------------

class DecodingError(TitanaxError):
    """A decoding request or the decode engine's cache cannot be served as asked (a pool too
    small for a request, a block of no tokens, a group of no samples)."""


class EvalTaskError(TitanaxError):
    """An lm-eval task cannot run as asked: its YAML does not parse, its data does not load, or
    it holds fewer few-shot examples than asked for."""
