"""The run's data on the mesh: which rows this process feeds, batches placed as global arrays,
and every configured input checked against the plan before the first step is spent.

A batch is cut into equal shards along the plan's batch axes; a process feeds exactly the shards
its devices hold (``parallel/batch_shards.py``) -- with the model or pipe axis across processes,
several processes feed the same rows.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Dict, Mapping, Optional

import jax
import numpy as np
from jax.sharding import Mesh

from titanax import errors
from titanax.data.pipeline import Input
from titanax.modules import input_limits
from titanax.modules.input_limits import InputLimit
from titanax.parallel import batch_shards
from titanax.parallel.plan import Plan

_log = logging.getLogger("titanax")


class RunInputs:
    """Inputs and batches of one run (its mesh and plan)."""

    def __init__(self, *, mesh: Mesh, plan: Plan,
                 limits: Optional[Mapping[str, InputLimit]] = None):
        """``limits``: what the model's inputs may hold (``model.input_limits()``); every host
        batch is checked against them before it is placed."""
        self.mesh, self.plan = mesh, plan
        # Where the rows and the sequence go (parallel/batch_layout.py).
        self.batch = plan.batch_layout()
        self.limits = dict(limits or {})

    def process_batch_shards(self):
        """``(shards, num_shards)``: the batch shards this process's devices hold, in order."""
        return batch_shards.process_shards(self.mesh, self.batch.row_entry)

    def global_batch(self, host_batch: Dict[str, np.ndarray]) -> Dict[str, jax.Array]:
        """Global arrays from this process's rows (checked against the plan first). Where the
        layout splits each row's sequence, it is split too, in the layout's order, with each
        token's positions (``BatchLayout.prepared``)."""
        shards, num_shards = self.process_batch_shards()
        leaves = jax.tree_util.tree_leaves(host_batch)
        if leaves and np.ndim(leaves[0]):
            self.plan.check_batch_size(np.shape(leaves[0])[0] // len(shards) * num_shards,
                                       self.mesh)
        host_batch = self.batch.prepared(host_batch, dict(self.mesh.shape))
        return batch_shards.place_batch(self.mesh, self.batch.row_entry, host_batch, shards,
                                        num_shards, seq_axis=self.batch.sequence_axis)

    def placed(self, batch: Any) -> Any:
        """A host batch as global arrays; global arrays as they are."""
        leaves = jax.tree_util.tree_leaves(batch)
        is_host = bool(leaves) and not isinstance(leaves[0], jax.Array)
        if not is_host:
            return batch
        input_limits.check_batch(batch, self.limits, model_path="model")
        return self.global_batch(batch)

    def check(self, config: Any) -> None:
        """The train input's and every evaler's batch size against the plan, and what each
        declares it holds against the model's limits (``config``: the Engine's)."""
        if config.train_input is not None and isinstance(config.train_input.global_batch_size,
                                                         int):
            self.plan.check_batch_size(config.train_input.global_batch_size, self.mesh,
                                       path="train_input.global_batch_size")
        train_tokenizer = (config.train_input.tokenizer.path
                           if config.train_input is not None else None)
        for name, evaler_cfg in _with_input(config.evalers):
            given = evaler_cfg.input.tokenizer.path
            if config.train_input is not None and given != train_tokenizer:
                raise errors.DataError(
                    f"the evaler tokenizes with {given or 'bytes'}, training with "
                    f"{train_tokenizer or 'bytes'}: its loss would measure other ids",
                    path=f"evalers[{name!r}].input.tokenizer.path",
                    suggestion=f"set it to {train_tokenizer!r} too" if train_tokenizer else
                    "leave it unset, like train_input's")
            batch = evaler_cfg.input.global_batch_size
            if isinstance(batch, int):
                self.plan.check_batch_size(batch, self.mesh, microbatched=False,
                                           path=f"evalers[{name!r}].input.global_batch_size")
        inputs = {"train_input": config.train_input,
                  **{f"evalers[{name!r}].input": e.input
                     for name, e in _with_input(config.evalers)}}
        for where, input_cfg in inputs.items():
            self._check_sequence_split(input_cfg, where=where)
        check_declarations(config, self.limits)
    def _check_sequence_split(self, input_cfg: Any, *, where: str) -> None:
        """Where the layout splits the sequence, a source's rows must cut into its chunks: said
        before the first step (not at the first batch, or the first evaluation)."""
        length = getattr(getattr(input_cfg, "source", None), "seq_len", None)
        chunks = self.batch.sequence_chunks(dict(self.mesh.shape))
        if chunks == 1 or not isinstance(length, int):
            return
        if length % chunks:
            raise errors.PlanError(
                f"rows of {length} tokens do not split into the {chunks} equal chunks context "
                f"parallelism cuts them into", path=f"{where}.source.seq_len",
                suggestion=f"use a multiple of {chunks}")

    def make(self, input_cfg: Optional[Input.Config], *, where: str,
             source: Any = None) -> Input:
        """The input of ``input_cfg`` for this process's batch shards; errors name ``where``
        (its config path); ``source``: its source already built (None: built here)."""
        if input_cfg is None:
            raise errors.DataError("no training data", path="engine.train_input",
                                   suggestion="set train_input, or pass data= to fit()")
        try:
            shards, num_shards = self.process_batch_shards()
            made = input_cfg.instantiate(shards=shards, num_shards=num_shards, source=source)
        except errors.DataError as e:
            in_source = input_cfg.source is not None and e.path in input_cfg.source.keys()
            in_input = e.path in input_cfg.keys() or (e.path or "").split(".")[0] in \
                input_cfg.keys()
            inner = (f"{where}.source.{e.path}" if e.path and in_source
                     else f"{where}.{e.path}" if e.path and in_input
                     else f"{where}.source: {e.path}" if e.path else where)
            raise errors.DataError(e.message, path=inner, suggestion=e.suggestion) from None
        self._check_first_example(made)
        return made

    def _check_first_example(self, made: Input) -> None:
        """The source's first example against the model's limits, before the run leaves any
        trace (later batches are checked as they are placed)."""
        source = getattr(made, "source", None)
        if not self.limits or source is None or not len(source):
            return
        example = source[0]
        if isinstance(example, Mapping):
            input_limits.check_batch({k: np.asarray(v)[None] for k, v in example.items()},
                                     self.limits, model_path="model")


def model_limits(model_cfg: Any) -> Dict[str, InputLimit]:
    """What the model's inputs may hold (``input_limits()``; none for a model without one)."""
    if model_cfg is None:
        return {}
    limits = getattr(model_cfg.instantiate(), "input_limits", None)
    return dict(limits()) if callable(limits) else {}


def check_declarations(config: Any, limits: Mapping[str, InputLimit]) -> None:
    """What every input of ``config`` (an Engine's: the train input and each evaler's) declares
    it holds (``data/declarations.py``: its tokenizer's vocabulary, its rows' length) against
    the model's ``limits`` -- before anything compiles, whatever ids the first batches happen to
    hold. A ``DataError`` names the model field to change."""
    inputs = {"train_input": getattr(config, "train_input", None),
              **{f"evalers[{name!r}].input": e.input
                 for name, e in _with_input(getattr(config, "evalers", None) or {})}}
    tokenizers: Dict[str, Any] = {}
    for where, input_cfg in inputs.items():
        declare = _declarer(input_cfg)
        if not limits or declare is None:
            continue
        _check_declared(input_cfg, declare, limits, where=where, tokenizers=tokenizers)


def _declarer(input_cfg: Any) -> Any:
    """The ``declare`` classmethod of ``input_cfg``'s source; None without one."""
    source = getattr(input_cfg, "source", None)
    return getattr(getattr(source, "klass", None), "declare", None)


def _declaration(input_cfg: Any, declare: Any, *, where: str,
                 tokenizers: Dict[str, Any]) -> Any:
    """What ``input_cfg``'s source declares (``tokenizers``: those built so far, by config);
    its errors name ``where``."""
    source = input_cfg.source
    key = input_cfg.tokenizer.debug_string()
    tokenizes = "tokenizer" in inspect.signature(source.klass.__init__).parameters
    try:
        if tokenizes and key not in tokenizers:
            tokenizers[key] = input_cfg.tokenizer.instantiate()
        return declare(source, tokenizer=tokenizers.get(key) if tokenizes else None)
    except errors.DataError as e:
        raise errors.DataError(e.message, path=f"{where}.{e.path}" if e.path else where,
                               suggestion=e.suggestion) from None


def _check_declared(input_cfg: Any, declare: Any, limits: Mapping[str, InputLimit], *,
                    where: str, tokenizers: Dict[str, Any]) -> None:
    """One input's declaration against the limits (``tokenizers``: those built so far, by
    config)."""
    declared = _declaration(input_cfg, declare, where=where, tokenizers=tokenizers)
    for name, count in declared.ids.items():
        limit = limits.get(name)
        if limit is None or limit.num_ids is None or count <= limit.num_ids:
            continue
        raise errors.DataError(
            f"{where} reads ids up to {count - 1} ({declared.ids_from}), but the model has "
            f"{limit.num_ids} ids [0, {limit.num_ids}) for batch[{name!r}]",
            path=f"model.{limit.num_ids_field}",
            suggestion=f"set model.{limit.num_ids_field} to at least {count} (with "
                       f"init_from: the checkpoint's vocabulary is what it is -- use its own "
                       f"tokenizer), or give {where}.tokenizer a vocabulary that fits")
    if declared.length is None:
        return
    for name, limit in limits.items():
        if limit.max_length is not None and declared.length > limit.max_length:
            raise errors.DataError(
                f"{where} makes rows of {declared.length} positions "
                f"({where}.source.{declared.length_field}), but the model reads at most "
                f"{limit.max_length} (batch[{name!r}])",
                path=f"model.{limit.max_length_field}",
                suggestion=f"raise model.{limit.max_length_field} to {declared.length}, or "
                           f"set {where}.source.{declared.length_field} to at most "
                           f"{limit.max_length}")


# Fields of an evaler's source that, left unset (None), follow the train input's source of the
# same kind: its files (their held-out split) and record format.
FOLLOWED_SOURCE_FIELDS = {"files": (), "format": ("text_field", "prompt_field",
                                                  "completion_field", "messages_field")}


def complete_from_train_input(config: Any) -> Any:
    """``config`` (an Engine's) with what it leaves to its train input filled in: the evalers'
    inputs (``follow_train_input``) and an unset ``model.vocab_size``
    (``vocab_from_train_input``)."""
    return vocab_from_train_input(follow_train_input(config))


def vocab_from_train_input(config: Any) -> Any:
    """``config`` (an Engine's) whose model leaves ``vocab_size`` unset (None) with the
    vocabulary its train input declares (its tokenizer's size, bytes' 256; pre-tokenized rows:
    the tokenizer they were written with), as TorchTitan sizes its model from its tokenizer; the
    run says so. Unchanged when the size is set or nothing declares a vocabulary (the model's
    validation then names the field)."""
    model = getattr(config, "model", None)
    train = getattr(config, "train_input", None)
    if model is None or "vocab_size" not in model.keys() or model.vocab_size is not None:
        return config
    declare = _declarer(train)
    if declare is None:
        return config
    declared = _declaration(train, declare, where="train_input", tokenizers={})
    if declared.vocabulary is None:
        return config
    out = config.clone()
    out.model.vocab_size = declared.vocabulary
    _log.info("model.vocab_size unset: %d, the train input's vocabulary (%s)",
              declared.vocabulary, declared.ids_from)
    return out


def follow_train_input(config: Any) -> Any:
    """``config`` (an Engine's) with every evaler's input completed from the train input's:
    a tokenizer left at its defaults becomes the train input's (the ids a held-out loss measures
    must be the ones trained on), and a source of the train source's kind takes its files and
    record format where it leaves them unset (None). Returns a new config when anything
    changes."""
    train = getattr(config, "train_input", None)
    evalers = getattr(config, "evalers", None) or {}
    if train is None or not evalers:
        return config
    default_tokenizer = type(train.tokenizer)().set(klass=train.tokenizer.klass)
    out = None
    for name, evaler in _with_input(evalers):
        changed = evaler.input.clone()
        if changed.tokenizer == default_tokenizer and train.tokenizer != default_tokenizer:
            changed.tokenizer = train.tokenizer.clone()
        source, train_source = changed.source, train.source
        if source is not None and train_source is not None and \
                getattr(source, "klass", None) is getattr(train_source, "klass", None):
            for field, companions in FOLLOWED_SOURCE_FIELDS.items():
                if field in source.keys() and getattr(source, field) is None and \
                        getattr(train_source, field) is not None:
                    setattr(source, field, getattr(train_source, field))
                    for companion in companions:
                        setattr(source, companion, getattr(train_source, companion))
        if changed != evaler.input:
            out = out or config.clone()
            out.evalers[name].input = changed
    return out or config


def _with_input(evalers: Mapping[str, Any]):
    """``(name, config)`` of the evalers that read an input (an lm-eval evaler reads none)."""
    return [(name, e) for name, e in evalers.items() if getattr(e, "input", None) is not None]
