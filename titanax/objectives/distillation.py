"""On-policy distillation (``llama_tiny_distill``): the student samples completions of the prompts
(the sampler GRPO uses: ``sampling.py``), a frozen teacher -- its own Hugging Face directory, any
size, the student's tokenizer -- scores every sampled position on the same mesh, and the loss is
a divergence between the two models' next-token distributions over the whole vocabulary at each
completion token (Agarwal et al. 2024, "On-policy distillation"; TRL's GKD with
``lmbda=1``).

``loss``: ``reverse_kl`` (KL(student || teacher), the default: mode-seeking, what on-policy
distillation usually minimises), ``forward_kl`` (KL(teacher || student)) or ``jsd`` (TRL's
generalized JSD with ``beta``; 0 and 1 are the forward and reverse KL, as TRL takes them).
The logits are divided by the sampling temperature. Both models' LM heads run in chunks of
tokens (``loss_chunk_tokens``) and each device holds its vocabulary slice of both
(``modules/layers/divergence.py``): no ``[tokens, vocabulary]`` logits of either model exist.
The loss is the mean over the batch's completion tokens; ``reverse_kl`` -- the mean per-token
KL(student || teacher) -- is logged whatever the loss.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, Literal, Optional, Tuple

import jax
import jax.numpy as jnp

from titanax import errors
from titanax.modules.layers.chunked_loss import chunk_length, chunked_token_losses
from titanax.modules.layers.divergence import KINDS, vocab_parallel_divergence
from titanax.modules.layers.moe import add_moe_objective
from titanax.modules.models.language_model import document_inputs
from titanax.modules.module import functional
from titanax.objectives import frozen
from titanax.objectives.batch_statistics import batch_mean
from titanax.objectives.sampling import SamplingObjective
from titanax.train.objective import OBJECTIVE_METRICS
from titanax.utils.dtypes import at_least_float32

# The params key of the frozen teacher.
TEACHER = "teacher"


class Distillation(SamplingObjective):
    """The student's divergence from a teacher on its own samples (see the module docstring)."""

    console_columns = ("reverse_kl", "loss", "completions/mean_length")

    class Config(SamplingObjective.Config):
        # A Hugging Face directory of the teacher (config.json, *.safetensors and the student's
        # tokenizer); required.
        teacher_from: Optional[str] = None
        # reverse_kl | forward_kl | jsd (the module docstring).
        loss: Literal["reverse_kl", "forward_kl", "jsd"] = "reverse_kl"
        # The generalized JSD's interpolation, in [0, 1] (jsd only).
        beta: float = 0.5
        # One completion per prompt (no group: nothing compares completions).
        num_generations = 1

        def _validate_values(self):
            yield from super()._validate_values()
            if self.loss not in KINDS:
                yield "loss", f"must be one of {', '.join(KINDS)}, got {self.loss!r}"
            if not (math.isfinite(self.beta) and 0.0 <= self.beta <= 1.0):
                yield "beta", f"must be in [0, 1], got {self.beta}"

    def __init__(self, cfg=None, **fields):
        super().__init__(cfg, **fields)
        self.teacher: Optional[Any] = None  # The teacher model (check).

    # --- At build ------------------------------------------------------------------------------

    def check(self, run: Any) -> None:
        super().check(run)
        directory = self.config.teacher_from
        if directory is None:
            raise errors.ConfigError("names no teacher", path="objective.teacher_from",
                                     suggestion="give the teacher's Hugging Face directory")
        frozen.check_hf_directory(directory, path="objective.teacher_from", what="teacher")
        self.teacher = _teacher_model(directory, student=run.model)
        try:
            run.plan.check_model(self.teacher, run.mesh)
        except errors.TitanaxError as e:  # (Its paths name the teacher's fields, not model.*.)
            raise type(e)(f"the teacher: {e.message} ({e.path})", path="objective.teacher_from",
                          suggestion=e.suggestion) from e
        _check_tokenizer(directory, run.config.train_input)
        source = getattr(run.config.train_input, "source", None)
        rows = getattr(source, "max_prompt_tokens", 0) + self.config.max_new_tokens
        limit = getattr(self.teacher.config, "max_seq_len", None)
        if limit is not None and rows > limit:
            raise errors.ConfigError(
                f"rows of {rows} tokens (prompts and completions) are longer than the teacher "
                f"reads (max_seq_len {limit})", path="objective.max_new_tokens",
                suggestion=f"lower it (or train_input.source.max_prompt_tokens) to fit {limit}")

    def frozen_specs(self, model_specs, *, run):
        return {TEACHER: frozen.frozen_copy_specs(
            self.teacher.create_parameter_specs_recursively())}

    def frozen_params(self, *, start, run):
        return {TEACHER: run.frozen_from_hf(self.config.teacher_from, key=TEACHER,
                                            model=self.teacher)}

    # --- The loss ------------------------------------------------------------------------------

    def loss(self, model, params, batch, *, key, is_training, batch_axes=()):
        return functional(model, key, params, (batch, tuple(batch_axes)),
                          method=self._distillation_loss, is_training=is_training)

    def _distillation_loss(self, model: Any, batch: Dict[str, jax.Array],
                           batch_axes: Tuple[str, ...]) -> Tuple[jax.Array, Dict[str, Any]]:
        """Runs as a method of ``model``: the mean divergence over this device's completion
        tokens (``batch["weights"]``), aux ``loss_sum`` / ``num_tokens``; the summary
        ``metrics/reverse_kl`` over the whole batch."""
        cfg = self.config
        inputs = dict(document_inputs(batch), input_ids=batch["input_ids"])
        student = model.final_hidden(**inputs)
        teacher_params = model.parameters[TEACHER]
        teacher, _ = functional(self.teacher, None, teacher_params, inputs,
                                method="final_hidden", is_training=False)
        width = student.shape[-1]
        hidden = jnp.concatenate([student, jax.lax.stop_gradient(teacher).astype(student.dtype)],
                                 axis=-1)
        head = model.head()

        def divergences(hidden_chunk, targets_chunk):
            del targets_chunk
            teacher_logits, _ = functional(self.teacher, None, teacher_params,
                                           (hidden_chunk[:, width:],), method="head_logits",
                                           is_training=False)
            loss, reverse = vocab_parallel_divergence(
                head.attend(hidden_chunk[:, :width]), teacher_logits, kind=cfg.loss,
                beta=cfg.beta, temperature=cfg.temperature, vocab_axis=head.vocab_axis,
                vocab_offset=head.vocab_offset(), vocab_size=model.config.vocab_size)
            return jnp.stack([loss, reverse], axis=-1)

        targets = batch["target_ids"]
        chunk = chunk_length(tokens=int(targets.size), local_vocab=2 * head.local_rows(),
                             requested=model.config.loss_chunk_tokens)
        per_token = chunked_token_losses(hidden, targets, loss_of_chunk=divergences, chunk=chunk)
        weights = at_least_float32(batch["weights"])
        loss_sum = jnp.sum(per_token[..., 0] * weights)
        count = jnp.sum(weights)
        model.add_summary(f"{OBJECTIVE_METRICS}/reverse_kl", batch_mean(
            jax.lax.stop_gradient(per_token[..., 1]) * weights, weights, batch_axes))
        loss = add_moe_objective(loss_sum / jnp.maximum(count, 1.0), model.collected_outputs())
        return loss, {"loss_sum": loss_sum, "num_tokens": count}

    def describe(self) -> Optional[str]:
        cfg = self.config
        loss = f"jsd (beta {cfg.beta})" if cfg.loss == "jsd" else cfg.loss
        return (f"objective: on-policy distillation, {loss} to the teacher {cfg.teacher_from} "
                f"(a frozen copy under params/{TEACHER}); {cfg.num_generations} completion(s) "
                f"per prompt of up to {cfg.max_new_tokens} tokens, temperature "
                f"{cfg.temperature}")


def _teacher_model(directory: str, *, student: Any) -> Any:
    """The teacher of the HF ``directory``, run as the student runs (its vocabulary padding,
    loss chunks and attention), refused when its vocabulary is not the student's."""
    from titanax.hf.model_configs import model_config_from_hf  # pylint: disable=import-outside-toplevel
    where = os.path.join(directory, "config.json")  # (Its weights load at step 0 only.)
    with open(where, encoding="utf-8") as f:
        cfg = model_config_from_hf(json.load(f), where=where)
    own, theirs = student.config.vocab_size, cfg.vocab_size
    if own != theirs:
        raise errors.ConfigError(
            f"the teacher's vocabulary has {theirs} ids and the student's {own}: a divergence "
            "compares the same ids' probabilities", path="objective.teacher_from",
            suggestion="distill from a teacher that shares the student's tokenizer")
    from titanax.hf.fine_tune import RUNTIME_FIELDS  # pylint: disable=import-outside-toplevel
    for name in RUNTIME_FIELDS:  # (How the student runs, but not its name.)
        if name != "name" and name in cfg.keys() and name in student.config.keys():
            setattr(cfg, name, getattr(student.config, name))
    return cfg.set(name=TEACHER).instantiate()


def _check_tokenizer(directory: str, train_input: Any) -> None:
    """The teacher's tokenizer must be the student's (the same ids, the same tokens)."""
    from titanax.data.tokenizer import Tokenizer, vocabulary_difference  # pylint: disable=import-outside-toplevel
    own = getattr(train_input, "tokenizer", None)
    if own is None:
        return
    try:
        theirs = Tokenizer.default_config().set(path=directory).instantiate()
    except errors.TitanaxError as e:
        raise errors.ConfigError(
            f"the teacher ships no tokenizer to compare with the student's ({e.message})",
            path="objective.teacher_from",
            suggestion="give a teacher directory with its tokenizer.json") from e
    difference = vocabulary_difference(own.instantiate(), theirs)
    if difference is not None:
        raise errors.ConfigError(
            f"the teacher's tokenizer is not the student's ({difference})",
            path="objective.teacher_from",
            suggestion="distill from a teacher trained with the student's tokenizer")
