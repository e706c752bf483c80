"""What objectives that train on completions the model samples share (GRPO, on-policy
distillation): the sampling fields, their checks against the run, the sampler on the training
mesh, and what ``--compile_only`` builds and reports for them.

The train input is a ``Prompts`` source; each prompt is completed ``num_generations`` times by the
run's KV-cache sampler (``StepBuilder.sampler``: the params and mesh the train step uses -- no
weights move) and each rollout feeds ``updates_per_rollout`` optimizer steps, ``iterations``
times over. The rows a step trains on are rollout rows (``rl/rows.py``).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from titanax import errors
from titanax.data.prompts import Prompts
from titanax.decoding.rollout_sampler import PagedDecoding
from titanax.observe.samples import SampleLog
from titanax.rl import rows as rollout_rows
from titanax.rl.rollouts import RolloutStream
from titanax.train import requirements
from titanax.train.objective import Objective


class SamplingObjective(Objective):
    """An objective whose batches the model samples (see the module docstring)."""

    class Config(Objective.Config):
        # Completions sampled per prompt (a group; its rows share one batch shard).
        num_generations: int = 8
        # Tokens sampled per completion (its budget; Dr. GRPO's max_completion_length).
        max_new_tokens: int = 64
        # Sampling temperature; the trained log-probs divide the logits by it too.
        temperature: float = 1.0
        # Nucleus sampling (1: the whole distribution).
        top_p: float = 1.0
        # Optimizer steps on each rollout batch, split into as many equal parts (TRL's
        # steps_per_generation).
        updates_per_rollout: int = 1
        # Passes over each rollout's updates (GRPO's mu, TRL's num_iterations).
        iterations: int = 1
        # Token ids that end a completion (it is scored and trained up to and including the
        # first); None: the tokenizer's end-of-sequence (and a chat template's end of turn).
        end_ids: Optional[Sequence[int]] = None
        # Every this many steps (and at the first), a rollout's first ``num_samples`` prompts,
        # completions and rewards are printed and appended to samples.jsonl in the run
        # directory (observe/samples.py); 0: never.
        samples_every: int = 10
        # Completions shown each time.
        num_samples: int = 2
        # The decode engine's sizes (decoding/rollout_sampler.py: one prefill per prompt,
        # continuously refilled slots over a paged cache); None: the static sampler.
        decoding: Optional[PagedDecoding.Config] = None

        def _validate_values(self):
            yield from super()._validate_values()
            if self.num_generations < 1:
                yield "num_generations", f"must be >= 1, got {self.num_generations}"
            if self.max_new_tokens < 1:
                yield "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}"
            if not (math.isfinite(self.temperature) and self.temperature > 0):
                yield "temperature", f"must be > 0 (the model samples), got {self.temperature}"
            if not 0 < self.top_p <= 1:
                yield "top_p", f"must be in (0, 1], got {self.top_p}"
            if self.updates_per_rollout < 1:
                yield "updates_per_rollout", f"must be >= 1, got {self.updates_per_rollout}"
            if self.iterations < 1:
                yield "iterations", f"must be >= 1, got {self.iterations}"
            if self.end_ids is not None and not self.end_ids:
                yield "end_ids", "is empty: give the ids that end a completion (or None)"
            for name in ("samples_every", "num_samples"):
                if getattr(self, name) < 0:
                    yield name, f"must be >= 0 (0: no samples shown), got {getattr(self, name)}"

    sources = (Prompts,)
    # The rollout's log-probs and per-row values enter the loss exactly (not in bfloat16).
    exact_fields = ("old_logps", "advantages", "row_weights", "weights")

    @property
    def temperature(self) -> float:
        return self.config.temperature

    def takes_user_data(self) -> bool:
        return False

    # --- At build ------------------------------------------------------------------------------

    def check(self, run: Any) -> None:
        super().check(run)
        cfg, model = run.config, run.model
        losses = sorted(name for name, e in cfg.evalers.items()
                        if getattr(e, "input", None) is not None)
        if losses:
            raise errors.ConfigError(
                f"evaluates {', '.join(losses)} by a held-out loss, and a {self.name} run has "
                "none: its measure is in its metrics (metrics.csv), or an lm-eval evaler's tasks",
                path="evalers",
                suggestion="set evalers={} (\"--config.evalers={}\"), or evaluate with an "
                           "LMEvalEvaler (titanax/harness/evaler.py)")
        requirements.require_whole_rows(
            cfg.plan, why=f"{self.name} samples whole rows on the training mesh and trains on "
                          "them whole", suggestion="train it with DP, TP and ZeRO / FSDP")
        if model is not None and not hasattr(model, "sample"):
            raise errors.ConfigError(
                f"{type(model).__name__} has no sampler (sample)", path="model",
                suggestion="train it with a decoder (modules/models/decoder.py: GPT-2, Llama, "
                           "Qwen, Mistral, MoE)")
        requirements.require_dropless(
            model, why="that differs between sampling one token at a time and training whole "
                       "rows: the trained log-probs would not be the sampled ones")
        self._check_batch(run)
        self._check_lengths(run)

    def _check_batch(self, run: Any) -> None:
        cfg, own = run.config, self.config
        if cfg.train_input is not None and cfg.train_input.last_batch == "pad":
            raise errors.ConfigError(
                "padding rows repeat a real prompt: their completions would be sampled, scored "
                "and trained on", path="train_input.last_batch",
                suggestion="use 'drop' (the default), or repeat the prompts (num_epochs=None)")
        if cfg.train_input is not None and isinstance(cfg.train_input.global_batch_size, int):
            shards = run.plan.batch_shards(run.mesh)
            rows = cfg.train_input.global_batch_size // max(shards, 1) * own.num_generations
            part = rows // own.updates_per_rollout
            if rows % own.updates_per_rollout or part % run.plan.accumulate_steps:
                raise errors.ConfigError(
                    f"each batch shard samples {rows} completions a rollout "
                    f"(train_input.global_batch_size / {shards} shards x num_generations), "
                    f"which do not split into {own.updates_per_rollout} updates of "
                    f"{run.plan.accumulate_steps} microbatch(es) each",
                    path="objective.updates_per_rollout",
                    suggestion="make the completions per shard a multiple of "
                               "updates_per_rollout x accumulate_steps")

    def _check_lengths(self, run: Any) -> None:
        own, model_cfg = self.config, getattr(run.model, "config", None)
        vocab = getattr(model_cfg, "vocab_size", None)
        for index, token in enumerate(own.end_ids or ()):
            if vocab is not None and not 0 <= token < vocab:
                raise errors.ConfigError(f"{token} is no token id of the model's {vocab}",
                                         path=f"objective.end_ids[{index}]",
                                         suggestion=f"give ids in [0, {vocab})")
        max_seq_len = getattr(model_cfg, "max_seq_len", None)
        prompt_tokens = self.prompt_width(run)
        if max_seq_len is not None and prompt_tokens is not None and \
                prompt_tokens + own.max_new_tokens > max_seq_len:
            raise errors.ConfigError(
                f"prompts of {prompt_tokens} tokens and completions of {own.max_new_tokens} "
                f"make rows the model (max_seq_len {max_seq_len}) cannot read",
                path="objective.max_new_tokens",
                suggestion=f"lower it (or {self.prompt_width_field}) to fit {max_seq_len}")

    # The config path of what sets the sampler's prompt width.
    prompt_width_field = "train_input.source.max_prompt_tokens"

    def prompt_width(self, run: Any) -> Optional[int]:
        """The sampler's prompt width (its prompts left-padded to it): the prompt input's."""
        source = getattr(run.config.train_input, "source", None)
        return getattr(source, "max_prompt_tokens", None)

    def input_limits(self, model_limits):
        if model_limits is None:
            return None
        return {"prompt_ids": model_limits["input_ids"]}

    # --- Batches: the rollout stream (rl/rollouts.py) ------------------------------------------

    # The rewards that score each rollout (rl/rewards.py: GRPO's); None: not scored.
    rewards: Optional[Any] = None

    def batches(self, made_input, *, run):
        if self.rewards is not None:  # (Before step 1: each function gets what it needs.)
            source = made_input.source
            available = set().union(*(source.fields_of(i) for i in range(len(source))))
            self.rewards.check_fields(sorted(available),
                                      source=f"train_input.source.files {source.config.files}")
        return RolloutStream(**self.stream_arguments(made_input, run=run))

    def stream_arguments(self, made_input, *, run) -> Dict[str, Any]:
        """What a rollout stream (``rl/rollouts.py``, and streams built on it) is made of."""
        end_ids = self.end_ids(made_input.source)
        shards, _ = run.process_batch_shards()
        own = self.config
        shown = getattr(run, "records_samples", True)
        samples = SampleLog(trainer_dir=run.trainer_dir if shown else None,
                            every=own.samples_every if shown else 0,
                            count=own.num_samples, writes=jax.process_index() == 0,
                            loggers=run.loggers())
        return dict(
            prompts=iter(made_input), source=made_input.source, objective=self,
            rewards=self.rewards, sample=self.sampler(run, end_ids=end_ids),
            params=lambda: run.state.params, place=run.inputs.placed, shards=shards,
            seed=run.config.seed, end_ids=end_ids, iterations=own.iterations,
            samples=samples, step=lambda: int(run.state.step),
            max_staleness=getattr(own, "max_staleness", 0))

    # --- The sampler ---------------------------------------------------------------------------

    def end_ids(self, source: Any) -> List[int]:
        """The configured end ids, else the prompts' tokenizer's (warned when it has none)."""
        own = self.config
        end_ids = list(own.end_ids) if own.end_ids is not None else source.end_ids()
        if not end_ids:
            print("titanax: warning: the tokenizer has no end-of-sequence token (and the prompts "
                  "no chat template's end of turn): every completion runs its whole budget "
                  f"(objective.max_new_tokens={own.max_new_tokens}); set objective.end_ids to "
                  "end them", flush=True)
        return end_ids

    def sampler(self, run: Any, *, end_ids: Sequence[int]) -> Any:
        own = self.config
        if own.decoding is not None:
            return own.decoding.instantiate().sampler(
                run, rows_per_shard=self._rows_per_shard(run), group=own.num_generations,
                max_new_tokens=own.max_new_tokens, temperature=own.temperature,
                top_p=own.top_p, end_ids=end_ids)
        return run.steps.sampler(max_new_tokens=own.max_new_tokens, temperature=own.temperature,
                                 top_p=own.top_p, end_ids=tuple(end_ids))

    def _rows_per_shard(self, run: Any) -> int:
        """A rollout's rows on each batch shard."""
        rows = run.config.train_input.global_batch_size * self.config.num_generations
        return rows // max(run.plan.batch_shards(run.mesh), 1)

    # --- --compile_only ------------------------------------------------------------------------

    def abstract_batch(self, run: Any):
        input_cfg, own = run.config.train_input, self.config
        rows = input_cfg.global_batch_size * own.num_generations // own.updates_per_rollout
        length = self.prompt_width(run) + own.max_new_tokens - 1
        return dict(rollout_rows.FIELDS), length, rows, rollout_rows.PER_ROW

    def compile_report(self, run: Any, *, state: Any, train_arguments: int) -> Dict[str, int]:
        """The sampler, compiled for one rollout's prompts: its temporaries (the key/value
        cache, a step's logits) and outputs come on top of the whole train state, which stays
        on the devices while it samples (``rollout_peak_bytes`` counts the train step's
        arguments: the state and one train batch)."""
        input_cfg = run.config.train_input
        # The program the run samples with: stopping at end tokens where it has them (the
        # configured ones, or the tokenizer's end of sequence).
        end_ids = self.config.end_ids
        if end_ids is None:
            eos = input_cfg.tokenizer.instantiate().eos_id
            end_ids = (eos,) if eos is not None else ()
        if self.config.decoding is not None:
            return self._engine_report(run, state=state, train_arguments=train_arguments,
                                       end_ids=end_ids)
        rows = input_cfg.global_batch_size * self.config.num_generations
        host = {"prompt_ids": np.zeros((rows, self.prompt_width(run)), np.int32),
                "prompt_lengths": np.zeros((rows,), np.int32)}
        specs = run.steps.batch_specs(host)
        prompts = {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                           sharding=NamedSharding(run.mesh, specs[k]))
                   for k, v in host.items()}
        analysis = self.sampler(run, end_ids=end_ids).lower(
            state.params, prompts["prompt_ids"], prompts["prompt_lengths"],
            jax.ShapeDtypeStruct((2,), np.uint32)).compile().memory_analysis()
        temp, out = int(analysis.temp_size_in_bytes), int(analysis.output_size_in_bytes)
        return {"sampler_temp_bytes": temp, "sampler_output_bytes": out,
                "rollout_peak_bytes": train_arguments + temp + out}

    def _engine_report(self, run: Any, *, state: Any, train_arguments: int,
                       end_ids: Sequence[int]) -> Dict[str, int]:
        """The decode engine's figures: its key/value pool sized in tokens
        (``decode_pool_tokens`` per batch shard, ``decode_pool_bytes`` per device: its shard's
        blocks, its share of the key/value heads) and its decode chunk at every slot compiled
        (``sampler_temp_bytes``); the pool and the chunk's temporaries come on top of the
        train state."""
        own, source = self.config, run.config.train_input.source
        sizes = own.decoding.instantiate().sizes(
            run, rows_per_shard=self._rows_per_shard(run), max_new_tokens=own.max_new_tokens,
            group=own.num_generations)
        engine = sizes.engine(run, state.params)
        width = -(-(source.max_prompt_tokens + own.max_new_tokens) // sizes.block_size)
        chunk = engine.chunk_memory(width=width, stops=max(len(end_ids), 1))
        pool, temp = engine.pool_bytes_per_device(), int(chunk.temp_size_in_bytes)
        return {"decode_pool_tokens": sizes.pool_tokens, "decode_slots": sizes.slots,
                "decode_pool_bytes": pool, "sampler_temp_bytes": temp,
                "rollout_peak_bytes": train_arguments + pool + temp}
