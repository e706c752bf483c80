"""The run's data on the mesh: which rows this process feeds, batches placed as global arrays,
and every configured input checked against the plan before the first step is spent.

A batch is cut into equal shards along the plan's batch axes; a process feeds exactly the shards
its devices hold (``parallel/batch_shards.py``) -- with the model or pipe axis across processes,
several processes feed the same rows.
"""

from __future__ import annotations

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


class RunInputs:
    """Inputs and batches of one run (its mesh and plan)."""

    def __init__(self, *, mesh: Mesh, plan: Plan,
                 limits: Optional[Mapping[str, InputLimit]] = None):
        """``limits``: what the model's inputs may hold (``model.input_limits()``); every host
        batch is checked against them before it is placed."""
        self.mesh, self.plan = mesh, plan
        self.limits = dict(limits or {})

    def process_batch_shards(self):
        """``(shards, num_shards)``: the batch shards this process's devices hold, in order."""
        return batch_shards.process_shards(self.mesh, self.plan.batch_axis)

    def global_batch(self, host_batch: Dict[str, np.ndarray]) -> Dict[str, jax.Array]:
        """Global arrays from this process's rows (checked against the plan first). Under
        context parallelism every row's sequence is split too, in the plan's order, with each
        token's positions (``CP.prepare``)."""
        shards, num_shards = self.process_batch_shards()
        leaves = jax.tree_util.tree_leaves(host_batch)
        if leaves and np.ndim(leaves[0]):
            self.plan.check_batch_size(np.shape(leaves[0])[0] // len(shards) * num_shards,
                                       self.mesh)
        cp = self.plan.context_parallel
        if cp is not None:
            host_batch = cp.prepare(host_batch, size=self.mesh.shape[cp.config.axis])
        return batch_shards.place_batch(self.mesh, self.plan.batch_axis, host_batch, shards,
                                        num_shards, seq_axis=self.plan.cp_axis)

    def placed(self, batch: Any) -> Any:
        """A host batch as global arrays; global arrays as they are."""
        leaves = jax.tree_util.tree_leaves(batch)
        is_host = bool(leaves) and not isinstance(leaves[0], jax.Array)
        if not is_host:
            return batch
        input_limits.check_batch(batch, self.limits, model_path="model")
        return self.global_batch(batch)

    def check(self, config: Any) -> None:
        """The train input's and every evaler's batch size against the plan (``config``: the
        Engine's)."""
        if config.train_input is not None and isinstance(config.train_input.global_batch_size,
                                                         int):
            self.plan.check_batch_size(config.train_input.global_batch_size, self.mesh,
                                       path="train_input.global_batch_size")
        train_tokenizer = (config.train_input.tokenizer.path
                           if config.train_input is not None else None)
        for name, evaler_cfg in config.evalers.items():
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
                  **{f"evalers[{name!r}].input": e.input for name, e in config.evalers.items()}}
        for where, input_cfg in inputs.items():
            self._check_sequence_split(input_cfg, where=where)

    def _check_sequence_split(self, input_cfg: Any, *, where: str) -> None:
        """Under context parallelism a source's rows must cut into the plan's chunks: said
        before the first step (not at the first batch, or the first evaluation)."""
        cp = self.plan.context_parallel
        length = getattr(getattr(input_cfg, "source", None), "seq_len", None)
        if cp is None or not isinstance(length, int):
            return
        chunks = cp.chunks(self.mesh.shape[cp.config.axis])
        if length % chunks:
            raise errors.PlanError(
                f"rows of {length} tokens do not split into the {chunks} equal chunks context "
                f"parallelism cuts them into", path=f"{where}.source.seq_len",
                suggestion=f"use a multiple of {chunks}")

    def make(self, input_cfg: Optional[Input.Config], *, where: str) -> Input:
        """The input of ``input_cfg`` for this process's batch shards; errors name ``where``
        (its config path)."""
        if input_cfg is None:
            raise errors.DataError("no training data", path="engine.train_input",
                                   suggestion="set train_input, or pass data= to fit()")
        try:
            shards, num_shards = self.process_batch_shards()
            made = input_cfg.instantiate(shards=shards, num_shards=num_shards)
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
