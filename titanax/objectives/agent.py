"""Multi-turn RL with tools and environments (``llama_tiny_agent``): the model acts, an
environment answers, and only the model's own tokens are trained.

An episode (``agents/episodes.py``): the environment's opening messages for a prompt record
(``reset``), rendered by the chat template; then, turn after turn, the model's turn sampled on
the training mesh and the environment's answer (``step``: tool results, a user's reply) until
it says done, after ``max_turns`` turns, or when the episode's ``max_tokens`` run out. The
episode's ids are grown as it is played, never re-tokenized (``agents/trajectory.py``): the ids
trained are the ids sampled, with the template's rendering of the environment's messages
between -- masked from the loss and the KL. The episode's reward is the sum of its turns'; the
GRPO family's advantages compare the ``num_generations`` episodes of one record; the loss is
GRPO's (``loss``, clipping, ``beta``: ``grpo.py``) on the episode rows.

``environment`` names a class by import path: ``reset(record) -> messages`` and
``step(messages) -> (new_messages, reward, done)`` (``agents/environment.py``). The common case,
tools and a scored answer, is ``agents/tool_environment.py``'s ``ToolEnvironment``; ``tools``
adds functions by import path to its own, each described to the model by its signature and
docstring (``agents/tool_schema.py``).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

from titanax import errors
from titanax.agents import environment as environment_lib
from titanax.agents.episode_stream import EpisodeStream
from titanax.agents.tool_schema import json_schema
from titanax.objectives.grpo import GRPO
from titanax.rl import rows as rollout_rows
from titanax.utils.import_path import import_object


class Agent(GRPO):
    """Episodes with an environment, trained by the GRPO family (module docstring)."""

    console_columns = ("reward", "turns/mean", "tool_calls/mean", "completions/mean_length",
                       "entropy")

    class Config(GRPO.Config):
        # The environment class, by import path (``package.module.ClassName``); required.
        environment: Optional[str] = None
        # Assistant turns per episode at most.
        max_turns: int = 4
        # Tokens per episode at most: the opening, the model's turns and the environment's
        # answers (each training row holds one episode; the sampler reads this wide).
        max_tokens: int = 256
        # Environments answering at once (a thread pool).
        workers: int = 8
        # Tool functions by import path, added to the environment's own ``tools`` (a
        # ToolEnvironment calls them); their schemas are rendered into the chat template.
        tools: Sequence[str] = ()

        def _validate_values(self):
            for path, problem in super()._validate_values():
                if path != "reward_functions":  # (The environment rewards.)
                    yield path, problem
            if not self.environment:
                yield "environment", "is required: name your environment class " \
                                     "(package.module.ClassName)"
            if self.max_turns < 1:
                yield "max_turns", f"must be >= 1, got {self.max_turns}"
            if self.max_tokens < 2:
                yield "max_tokens", f"must be >= 2, got {self.max_tokens}"
            if self.workers < 1:
                yield "workers", f"must be >= 1, got {self.workers}"
            if self.reward_functions or self.rewards:
                yield "reward_functions", "an agent's rewards are its environment's (step's " \
                                          "reward): drop reward_functions and rewards"
            if self.decoding is not None:
                yield "decoding", "episodes are sampled by the static sampler: set it to None"
            if self.end_ids is not None:
                yield "end_ids", "a turn ends at the chat template's end of turn (the " \
                                 "trajectory's turns are cut there): leave it None"
            if self.max_staleness:
                yield "max_staleness", f"episodes are played on-policy: must be 0, got " \
                                       f"{self.max_staleness}"

    def __init__(self, cfg=None, **fields):
        super().__init__(cfg, **fields)
        # The configured tools (``tools``, imported at build) and the schemas rendered into
        # the chat template (the environment's own tools', then these).
        self.tool_functions: List[Callable] = []
        self.tool_schemas: List[dict] = []
        # The environment class (imported and checked at build).
        self._environment_class: Optional[type] = None

    # --- At build ------------------------------------------------------------------------------

    def check(self, run: Any) -> None:
        cfg = self.config
        self.tool_functions = [import_object(path, where=f"objective.tools[{i}]",
                                             what="function", error=errors.AgentError)
                               for i, path in enumerate(cfg.tools)]
        # (A wrong path or class stops the build; the class is imported and checked once.)
        environment = environment_lib.load_environment(cfg.environment,
                                                       where="objective.environment")
        self._environment_class = type(environment)
        self.tool_schemas = [json_schema(tool, where="objective.environment")
                             for tool in getattr(environment, "tools", ())]
        self.tool_schemas += [json_schema(tool, where=f"objective.tools[{i}]")
                              for i, tool in enumerate(self.tool_functions)]
        super().check(run)

    def reward_set(self) -> None:
        return None  # (The environment rewards.)

    def make_environment(self) -> Any:
        """A fresh environment (of the class ``check`` imported), the configured tools added
        to its own."""
        environment = self._environment_class()
        if self.tool_functions:
            environment.tools = (*getattr(environment, "tools", ()), *self.tool_functions)
        return environment

    @staticmethod
    def _check_template(tokenizer: Any) -> None:
        """A turn must end: the chat template writes a special token after it (checked with
        the data, before step 1; ``--compile_only`` reads no data)."""
        if not tokenizer.chat_end_ids():
            raise errors.AgentError(
                "the tokenizer's chat template writes no special token after an assistant's "
                "turn: a sampled turn could not end", path="train_input.tokenizer",
                suggestion="use a tokenizer whose chat template ends a turn with a special "
                           "token (<|im_end|>, <|eot_id|>, ...)")

    prompt_width_field = "objective.max_tokens"

    def prompt_width(self, run: Any) -> int:
        return self.config.max_tokens

    @property
    def completion_budget(self) -> int:
        return self.config.max_tokens

    # --- Batches -------------------------------------------------------------------------------

    def batches(self, made_input, *, run):
        cfg = self.config
        self._check_template(made_input.source.tokenizer)
        return EpisodeStream(make_environment=self.make_environment, tools=self.tool_schemas,
                             max_turns=cfg.max_turns, max_tokens=cfg.max_tokens,
                             workers=cfg.workers, **self.stream_arguments(made_input, run=run))

    def end_ids(self, source: Any) -> List[int]:
        """The turn's end: the chat template's end of turn."""
        return source.tokenizer.chat_end_ids()

    def abstract_batch(self, run: Any):
        input_cfg, own = run.config.train_input, self.config
        rows = input_cfg.global_batch_size * own.num_generations // own.updates_per_rollout
        return (dict(rollout_rows.FIELDS), own.max_tokens - 1, rows, rollout_rows.PER_ROW)

    def describe(self) -> Optional[str]:
        cfg = self.config
        tools = ", ".join(s["function"]["name"] for s in self.tool_schemas) or "none"
        return (f"objective: agent, {cfg.loss} ({cfg.num_generations} episodes per record with "
                f"{cfg.environment}: up to {cfg.max_turns} turns of {cfg.max_new_tokens} tokens, "
                f"{cfg.max_tokens} tokens in all, temperature {cfg.temperature}; tools: {tools}; "
                f"beta {cfg.beta})")
