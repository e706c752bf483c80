"""Parallel plans: which mesh axis does what, and how every param is laid out.

A ``Plan`` composes the roles a mesh axis can play -- data parallel (``DP``), tensor parallel
(``TP``), pipeline parallel (``PP``), context parallel (``CP``, context_parallel.py), expert
parallel (``EP``, expert_parallel.py) -- and ZeRO / FSDP state sharding (``ZeRO``). They are all
Configurables, so a plan lives in the run's config tree and every field overrides from the command
line (``--config.plan.data_parallel.accumulate_steps=4``).

``Plan.validate(mesh)`` checks the plan against a real mesh before anything compiles;
``Plan.describe(params, mesh)`` prints the layout of every param and what it costs per device.
"""

from __future__ import annotations

import dataclasses

from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

from jax.sharding import Mesh, PartitionSpec

from titanax import errors
from titanax.config import Configurable
from titanax.parallel import axis_binding as axis_binding_lib
from titanax.parallel.axis_binding import AxisBinding
from titanax.parallel import batch_layout as batch_layout_lib
from titanax.parallel import interleaved_stack, layout as layout_lib, logical_axes, one_f_one_b
from titanax.parallel import pipeline
from titanax.parallel import rules as rules_lib
from titanax.parallel import sharding, state_dims
from titanax.parallel.context_parallel import CP, SequenceSplit
from titanax.parallel.expert_parallel import EP, ExpertRows

SpecEntry = Optional[Union[str, Tuple[str, ...]]]


class DP(Configurable):
    """Data parallelism: the batch is split over ``axis``; gradients are averaged over it once."""

    class Config(Configurable.Config):
        # Mesh axis the batch is split over.
        axis: str = "data"
        # Microbatches per step: each device's batch is split into this many pieces that run
        # sequentially (a lax.scan), gradients summed locally and reduced once after the loop.
        accumulate_steps: int = 1
        # Average the step's metrics (loss, ...) over the data axis before reporting them.
        sync_metrics: bool = True

        def _validate_values(self):
            if self.accumulate_steps < 1:
                yield "accumulate_steps", f"must be >= 1, got {self.accumulate_steps}"


class TP(Configurable):
    """Tensor parallelism over ``axis``: layers split their weights and call collectives.

    ``rules`` override the layouts layers declare; the first matching pattern wins.
    """

    class Config(Configurable.Config):
        # Mesh axis weights are split over.
        axis: str = "model"
        # {param path pattern: spec}; '*' matches within a path segment, '**' across segments,
        # 're:<regex>' is a regular expression. Example: {'**/mlp/up/weight': (None, 'model')}.
        rules: Dict[str, Tuple[SpecEntry, ...]] = {}
        # Sequence parallelism (Megatron): the residual stream between blocks is split over the
        # sequence on this axis; row-parallel layers end with a reduce-scatter instead of an
        # all-reduce, and column-parallel ones all-gather their input.
        sequence_parallel: bool = False
        # Allow row-parallel layers to end with a reduce-scatter over the sequence instead of an
        # all-reduce (what sequence_parallel does). False forbids it, so the plan states every
        # collective kind: sequence_parallel=True is then refused.
        prefer_reduce_scatter: bool = True

        def _validate_values(self):
            if self.sequence_parallel and not self.prefer_reduce_scatter:
                yield "sequence_parallel", ("ends row-parallel layers with a reduce-scatter, "
                                            "which prefer_reduce_scatter=False forbids: allow "
                                            "reduce-scatter, or set sequence_parallel=False")

    def spec_for(self, param_path: str, param_shape: Tuple[int, ...],
                 mesh: Optional[Mesh] = None) -> PartitionSpec:
        """The spec this plan's rules give ``param_path`` (first match, checked)."""
        return sharding.spec_for(param_path, param_shape, self.config.rules, mesh)


class PP(Configurable):
    """Pipeline parallelism: stages of layers over ``axis``, microbatches flowing between them.

    The stages are either the ``Repeat`` stack at ``stacked_layers`` split evenly (the fast path:
    layers viewed as ``[virtual_stages, stages, layers per stage, ...]`` with the stage dimension
    on ``axis``), or, as in the seed's API, explicit ``stages``. The number of stages S is the
    size of ``axis``; each data shard's batch is cut into M = local batch / microbatch_size
    microbatches. Bubble: (S - 1) / (v M + S - 1).
    """

    class Config(Configurable.Config):
        # Mesh axis the stages are laid out on.
        axis: str = "pipe"
        # The seed's explicit stages (Stage(name, param_filter, fwd), ...); empty: the Repeat
        # stack named by stacked_layers, split evenly over the stages.
        stages: Sequence[Any] = ()
        # Param path of the stacked (Repeat) layers that are split over the stages.
        stacked_layers: str = "decoder/layer"
        # Examples per microbatch per data shard: M = local batch / microbatch_size.
        microbatch_size: int = 1
        # "gpipe": all forwards, then all backwards; "circular": GPipe with virtual_stages
        # stage slices per device (a smaller bubble); "1f1b": forwards and backwards
        # interleaved, at most S microbatches of activations live per stage whatever M is.
        schedule: Literal["gpipe", "circular", "1f1b"] = "1f1b"
        # Stage slices per device (circular only): layers per device come in this many chunks.
        virtual_stages: int = 1
        # Fraction of each stage's layers whose activations are rematerialised in backward
        # (GPipe / circular): 1 keeps only each tick's input and recomputes the tick; 0.5 runs
        # the first half of every stage's layers under jax.checkpoint. 1F1B recomputes a
        # stage's forward in its backward whatever this says (its activations never pile up).
        checkpoint_ratio: float = 0.0

        def _validate_values(self):
            if self.microbatch_size < 1:
                yield "microbatch_size", f"must be >= 1, got {self.microbatch_size}"
            if self.virtual_stages < 1:
                yield "virtual_stages", f"must be >= 1, got {self.virtual_stages}"
            if self.virtual_stages > 1 and self.schedule != "circular":
                yield "virtual_stages", (f"{self.virtual_stages} virtual stages need "
                                         f"schedule='circular', not {self.schedule!r}")
            if not 0.0 <= self.checkpoint_ratio <= 1.0:
                yield "checkpoint_ratio", f"must be in [0, 1], got {self.checkpoint_ratio}"

    def num_microbatches(self, local_batch_size: int) -> int:
        """M for a data shard's batch of ``local_batch_size`` examples."""
        return local_batch_size // self.config.microbatch_size

    def schedule_numbers(self, *, num_stages: int, local_batch: int) -> Tuple[int, int, float]:
        """``(M, ticks, bubble)`` of this schedule for a data shard's batch: GPipe and circular
        take ``vM + S - 1`` ticks, idle ``(S - 1) / (vM + S - 1)``; 1F1B's static table says."""
        cfg = self.config
        count = self.num_microbatches(local_batch)
        if cfg.schedule == "1f1b":
            table = one_f_one_b.build_schedule(num_stages, count)
            return count, table.num_ticks, table.bubble()
        virtual = cfg.virtual_stages if cfg.schedule == "circular" else 1
        ticks = virtual * count + num_stages - 1
        return count, ticks, pipeline.bubble_fraction(
            num_stages=num_stages, num_microbatches=count, virtual_stages=virtual)

    def layout_transforms(self) -> List[Any]:
        """PP's part of the layout pipeline: the stage split of the stacked layers, and the
        circular schedule's view of them (explicit stages keep every param replicated)."""
        cfg = self.config
        if cfg.stages:
            self._check_explicit_stages()
            return []
        transforms = [pipeline.StageSplit(stacked_layers=cfg.stacked_layers, pipe_axis=cfg.axis)]
        if cfg.schedule == "circular" and cfg.virtual_stages > 1:
            transforms.append(interleaved_stack.CircularView(
                stacked_layers=cfg.stacked_layers, pipe_axis=cfg.axis,
                virtual_stages=cfg.virtual_stages))
        return transforms

    def _check_explicit_stages(self) -> None:
        """What explicit stages cannot run, refused before anything is built."""
        cfg = self.config
        if cfg.virtual_stages > 1:
            raise errors.PlanError(
                "explicit stages run one stage per device: virtual stages need the stacked "
                "path", path="plan.pipeline_parallel.virtual_stages",
                suggestion="set virtual_stages=1 (schedule gpipe or 1f1b), or pipeline a "
                           "Repeat stack (stages=[])")
        if 0.0 < cfg.checkpoint_ratio < 1.0:
            raise errors.PlanError(
                f"checkpoint_ratio {cfg.checkpoint_ratio}: explicit stages are rematerialised "
                "whole or not at all", path="plan.pipeline_parallel.checkpoint_ratio",
                suggestion="use 0 or 1 (1: each tick recomputed from its input)")


class ZeRO(Configurable):
    """Sharded state over one mesh axis, along real param dimensions (parallel/state_dims.py).

    Stage 1 shards the optimizer state (gradients all-reduced, each device updates its part,
    params all-gathered back); stage 2 also reduce-scatters the gradients into that layout;
    stage 3 (FSDP) stores the params sharded too and gathers them where they are used.
    """

    class Config(Configurable.Config):
        # 1: optimizer state; 2: + gradients reduce-scattered; 3: + params (FSDP).
        stage: Literal[1, 2, 3] = 1
        # Mesh axis the state is split over; None: the data-parallel axis. Another axis (e.g.
        # "fsdp" next to "data") gives HSDP: the batch is split over both axes, the state over
        # this one only, and the data-axis all-reduce still happens once per step.
        axis: Optional[str] = None
        # Stage 3 only. "per_microbatch" (true ZeRO-3): each layer's params are gathered where
        # the layer runs, inside the layer and microbatch loops, and the gradients
        # reduce-scattered there (lowest memory). "per_step": gathered once before the
        # microbatch loop and reduce-scattered once after it (no collective in any loop, the
        # whole model gathered while the step runs).
        grad_sync: Literal["per_step", "per_microbatch"] = "per_microbatch"
        # Params with fewer elements stay whole on every device (norm scales, small biases).
        min_shard_size: int = 256
        # {param path pattern: dimension (negative counts from the end) or None (keep whole)};
        # first match wins, before the default (the largest divisible dimension).
        dim_overrides: Dict[str, Optional[int]] = {}
        # Stage 3, grad_sync "per_microbatch": more mesh axes the batch's rows are split over
        # (expert parallelism's) that each param not already split over them is split over too,
        # with ``axis``, on its one dimension: e.g. ("expert",) spreads the dense params of an
        # MoE model over data x expert devices while the experts, split over expert, add data
        # alone (as MaxText shards its dense weights over its expert axis). Each gather then
        # spans those axes, and its transpose sums the gradient over them.
        also_over: Sequence[str] = ()

        def _validate_values(self):
            if isinstance(self.min_shard_size, int) and self.min_shard_size < 0:
                yield "min_shard_size", f"must be >= 0, got {self.min_shard_size}"
            if self.also_over and (self.stage != 3 or self.grad_sync != "per_microbatch"):
                yield "also_over", ("splits the params themselves, gathered where each layer "
                                    "runs: it needs stage=3 and grad_sync='per_microbatch'")

    @property
    def fsdp(self) -> bool:
        """Whether the params themselves are sharded (stage 3)."""
        return self.config.stage == 3

    def layout_transforms(self, *, axis: str) -> List[Any]:
        """ZeRO's part of the layout pipeline: the state split over ``axis``."""
        cfg = self.config
        return [state_dims.StateSplit(axis=axis, params_sharded=self.fsdp,
                                      min_shard_size=cfg.min_shard_size,
                                      dim_overrides=tuple(cfg.dim_overrides.items()),
                                      also_over=tuple(cfg.also_over))]


class Plan(Configurable):
    """Composition of DP, TP, PP and ZeRO. Any of them may be absent."""

    class Config(Configurable.Config):
        # Data parallelism (None: the batch is not split).
        data_parallel: Optional[DP.Config] = None
        # Tensor parallelism (None: layers run unsplit).
        tensor_parallel: Optional[TP.Config] = None
        # Pipeline parallelism (None: one stage).
        pipeline_parallel: Optional[PP.Config] = None
        # ZeRO optimizer-state sharding (None: the optimizer state is replicated).
        zero: Optional[ZeRO.Config] = None
        # Context parallelism: the sequence split over an axis (None: whole sequences).
        context_parallel: Optional[CP.Config] = None
        # Expert parallelism: MoE layers' experts (and the batch's rows) split over an axis
        # (None: every device holds every expert).
        expert_parallel: Optional[EP.Config] = None
        # {logical axis name: mesh axis or None} for params that name their dimensions (a Flax
        # model's partitioning metadata, e.g. {'embed': 'data', 'mlp': None}): the ZeRO / FSDP
        # axis puts the state split on that dimension, the TP axis splits it (a model that
        # calls the collectives itself), None keeps it whole; names without a rule stay whole,
        # a rule for a name no param uses is refused (parallel/logical_axes.py).
        logical_axis_rules: Dict[str, Optional[str]] = {}

        def _validate_values(self):
            roles = self._roles()
            seen: Dict[str, str] = {}
            for role, axis in roles.items():
                if axis in seen:
                    yield f"{role}.axis", (f"mesh axis {axis!r} already serves "
                                           f"{seen[axis]}; one axis, one role")
                seen.setdefault(axis, role)
            if self.zero is not None and self.data_parallel is None:
                yield "zero", "ZeRO shards the state over the data axis: add data_parallel"
            owners = {axis_binding_lib.SEQUENCE: "context_parallel",
                      axis_binding_lib.RESIDUAL_SEQUENCE: "tensor_parallel.sequence_parallel",
                      axis_binding_lib.EXPERTS: "expert_parallel",
                      axis_binding_lib.STAGES: "pipeline_parallel"}
            for name in self.logical_axis_rules:
                if name in owners:
                    yield f"logical_axis_rules[{name!r}]", (
                        f"{name!r} is split by the layers' own code, which plan.{owners[name]} "
                        "configures; a rule cannot move or unbind it")
            cp, pp = self.context_parallel, self.pipeline_parallel
            if cp is not None and cp.strategy == "ring" and pp is not None \
                    and pp.schedule == "1f1b":
                yield "context_parallel.strategy", (
                    "the ring's collective-permutes would run inside 1F1B's per-tick switch, "
                    "where stages take different branches (it deadlocks on XLA:CPU): use "
                    "'all_gather' or 'ulysses' with 1F1B, or the ring with GPipe / circular")
            if self.context_parallel is not None and self.data_parallel is not None \
                    and not self.data_parallel.sync_metrics:
                yield "data_parallel.sync_metrics", (
                    "reports one data shard's values, which context parallelism spreads over "
                    "several devices (each holding part of every row): leave it True")
            yield from self._also_over_problems()
            pp = self.pipeline_parallel
            if self.zero is not None and self.zero.stage == 3 and pp is not None \
                    and not self.zero.also_over:
                if pp.stages:
                    yield "zero.stage", ("explicit pipeline stages hold every param on every pipe "
                                         "device; FSDP (stage 3) runs the stacked path only: use "
                                         "stage 1 or 2 with explicit stages")
                elif self.zero.grad_sync == "per_microbatch":
                    yield "zero.grad_sync", ("FSDP under a pipeline gathers the params once per "
                                             "step: set it to 'per_step'")

        def _also_over_problems(self):
            """What ``zero.also_over`` cannot split over (see its field)."""
            if self.zero is None:
                return
            rows = {part.axis for part in (self.data_parallel, self.expert_parallel)
                    if part is not None} | ({self.zero.axis} - {None})
            primary = self.zero.axis or (self.data_parallel.axis
                                         if self.data_parallel is not None else None)
            also = list(self.zero.also_over)
            if len(set(also)) != len(also):
                yield "zero.also_over", f"names a mesh axis twice: {also}"
            if also and self.zero.axis is not None and self.data_parallel is not None \
                    and self.zero.axis != self.data_parallel.axis:
                yield "zero.also_over", (
                    "with ZeRO's own axis (HSDP) is not built: the data all-reduce would "
                    "cross the gathered axes again; give ZeRO the data axis")
            if also and self.pipeline_parallel is not None:
                yield "zero.also_over", ("gathers where each layer runs, which a pipeline's "
                                         "FSDP (grad_sync='per_step') does not")
            for axis in also:
                if axis == primary:
                    yield "zero.also_over", f"mesh axis {axis!r} is the ZeRO axis itself"
                elif axis not in rows:
                    yield "zero.also_over", (
                        f"mesh axis {axis!r} does not split the batch's rows (the data, "
                        f"ZeRO or expert axis): a gradient gathered over it would be summed "
                        f"over copies")

        def _roles(self) -> Dict[str, str]:
            roles = {}
            for role in ("data_parallel", "tensor_parallel", "pipeline_parallel",
                         "context_parallel", "expert_parallel"):
                part = getattr(self, role)
                if part is not None:
                    roles[role] = part.axis
            if self.zero is not None and self.zero.axis is not None and (
                    self.data_parallel is None or self.zero.axis != self.data_parallel.axis):
                roles["zero"] = self.zero.axis  # HSDP: an axis of its own.
            return roles

    def __init__(self, cfg=None, **fields):
        super().__init__(cfg, **fields)
        cfg = self.config
        self.data_parallel: Optional[DP] = _maybe(cfg.data_parallel)
        self.tensor_parallel: Optional[TP] = _maybe(cfg.tensor_parallel)
        self.pipeline_parallel: Optional[PP] = _maybe(cfg.pipeline_parallel)
        self.zero: Optional[ZeRO] = _maybe(cfg.zero)
        self.context_parallel: Optional[CP] = _maybe(cfg.context_parallel)
        self.expert_parallel: Optional[EP] = _maybe(cfg.expert_parallel)
        self._batch_layout: Optional[batch_layout_lib.BatchLayout] = None

    # --- Roles -----------------------------------------------------------------------------------

    @property
    def dp_axis(self) -> Optional[str]:
        return self.config.data_parallel.axis if self.config.data_parallel else None

    @property
    def tp_axis(self) -> Optional[str]:
        return self.config.tensor_parallel.axis if self.config.tensor_parallel else None

    @property
    def pp_axis(self) -> Optional[str]:
        return self.config.pipeline_parallel.axis if self.config.pipeline_parallel else None

    @property
    def zero_axis(self) -> Optional[str]:
        """The axis ZeRO / FSDP split the state over (None: no ZeRO)."""
        if self.config.zero is None:
            return None
        return self.config.zero.axis or self.dp_axis

    @property
    def hsdp(self) -> bool:
        """Whether ZeRO / FSDP has an axis of its own next to the data axis (HSDP)."""
        return self.zero_axis is not None and self.zero_axis != self.dp_axis

    @property
    def batch_axes(self) -> Tuple[str, ...]:
        """The mesh axes the batch's rows are split over (``batch_layout().row_axes``): the
        data axis, under HSDP the ZeRO axis too, and the expert axis."""
        return self.batch_layout().row_axes

    @property
    def ep_axis(self) -> Optional[str]:
        return self.config.expert_parallel.axis if self.config.expert_parallel else None

    @property
    def cp_axis(self) -> Optional[str]:
        return self.config.context_parallel.axis if self.config.context_parallel else None

    @property
    def token_axes(self) -> Tuple[str, ...]:
        """The mesh axes a batch's tokens are split over (rows, and each row's sequence)."""
        return self.batch_layout().token_axes

    @property
    def batch_axis(self) -> sharding.AxisEntry:
        """``batch_axes`` as one spec entry / collective axis argument: None, the data axis, or
        (under HSDP) the tuple of both."""
        return sharding.axis_entry(self.batch_axes)

    def batch_shards(self, mesh: Mesh) -> int:
        """How many parts the batch is split into (the product of the batch axes' sizes)."""
        return sharding.axes_size(dict(mesh.shape), self.batch_axes)

    @property
    def accumulate_steps(self) -> int:
        return self.config.data_parallel.accumulate_steps if self.config.data_parallel else 1

    def roles(self) -> Dict[str, str]:
        """``{mesh axis: role}`` for every axis the plan uses."""
        return {axis: role for role, axis in self.config._roles().items()}  # pylint: disable=protected-access

    # --- Checks ----------------------------------------------------------------------------------

    def validate(self, mesh: Mesh, *, global_batch_size: Optional[int] = None) -> "Plan":
        """Checks the plan against ``mesh`` (and the batch size, when known). Returns ``self``."""
        mesh_shape = dict(mesh.shape)
        for role, axis in self.config._roles().items():  # pylint: disable=protected-access
            if axis not in mesh_shape:
                raise errors.PlanError(
                    f"{role} uses mesh axis {axis!r}, which the mesh does not have",
                    path=f"plan.{role}.axis",
                    suggestion=f"mesh axes: {', '.join(mesh_shape)}; rename the axis in the plan "
                               "or add it to the mesh, e.g. "
                               f"--config.mesh.axes=\"{tuple(mesh_shape) + (axis,)}\" "
                               f"--config.mesh.shape=\"{(None,) + (1,) * (len(mesh_shape) - 1) + (2,)}\"")
        roles = self.roles()
        idle = [a for a, size in mesh_shape.items() if size > 1 and a not in roles]
        if idle:
            raise errors.PlanError(
                f"mesh axis {idle[0]!r} (size {mesh_shape[idle[0]]}) has no role in the plan: "
                "every device along it would repeat the same work", path=f"mesh axis {idle[0]!r}",
                suggestion="give it a role (data_parallel, tensor_parallel, pipeline_parallel, "
                           "context_parallel, expert_parallel, or zero.axis for HSDP) or set its "
                           "size to 1")
        if global_batch_size is not None:
            self.check_batch_size(global_batch_size, mesh)
        return self

    def check_batch_size(self, global_batch_size: int, mesh: Mesh, *,
                         path: Optional[str] = None, microbatched: bool = True) -> None:
        """The global batch must split evenly into data shards (x microbatches when training).

        ``path`` names the config field that set the batch size, for the error.
        """
        data = self.batch_shards(mesh)
        steps = self.accumulate_steps if microbatched else 1
        parts = data * steps
        axes = " x ".join(repr(a) for a in self.batch_axes)
        if global_batch_size % parts or global_batch_size < parts:
            if len(self.batch_axes) > 1:
                shards = f"{data} batch shards (mesh axes {axes})"
            else:
                shards = f"data-axis size {data}" + ("" if steps > 1 else f" (mesh axis {axes})")
            split = f"{shards} x accumulate_steps {steps} = {parts}" if steps > 1 else shards
            raise errors.PlanError(
                f"global batch size {global_batch_size} is not divisible by {split}",
                path=path or ("plan.data_parallel.accumulate_steps" if steps > 1
                              else f"mesh axis {axes}"),
                suggestion=f"use a batch size that is a multiple of {parts}, e.g. "
                           f"{max(parts, global_batch_size - global_batch_size % parts)}")
        if self.pipeline_parallel is not None:  # Eval batches go through the pipeline too.
            self._check_pipeline_batch(global_batch_size // data, mesh, accumulate_steps=steps)

    def _check_pipeline_batch(self, local_batch: int, mesh: Mesh, *,
                              accumulate_steps: int = 1) -> None:
        """M = local batch / microbatch_size must be whole and >= S (every schedule, the circular
        one included, runs any M >= S). Gradient accumulation folds into the microbatches: each
        of the ``accumulate_steps`` parts of a shard's batch is cut into whole microbatches, and
        the schedule runs all of them (M = accumulate_steps x microbatches per part) before the
        one reduction of the step."""
        pp = self.pipeline_parallel
        cfg = pp.config
        stages = mesh.shape[cfg.axis]
        where = "plan.pipeline_parallel.microbatch_size"
        part = local_batch // accumulate_steps
        if part % cfg.microbatch_size:
            of = (f"each of the {accumulate_steps} accumulation parts ({part} rows) of the "
                  f"per-data-shard batch" if accumulate_steps > 1
                  else f"the per-data-shard batch of {local_batch}")
            raise errors.PlanError(
                f"microbatches of {cfg.microbatch_size} do not divide {of}", path=where,
                suggestion="choose a microbatch_size that divides it")
        pipeline.check_fills(num_microbatches=pp.num_microbatches(local_batch), num_stages=stages)

    # --- Param layouts ---------------------------------------------------------------------------

    def sharding_rules(self) -> List[rules_lib.Rule]:
        tp = self.config.tensor_parallel
        return rules_lib.normalize_rules(tp.rules if tp is not None else None)

    def layout_transforms(self) -> List[layout_lib.LayoutTransform]:
        """The layout pipeline's transforms, in their fixed order (parallel/layout.py): logical
        axis rules, layer layouts + TP rules, the rows' split (DP), then PP's and ZeRO's, the
        sequence's (CP) and the experts' rows (EP), then size-1 axes dropped."""
        transforms: List[layout_lib.LayoutTransform] = [
            logical_axes.LogicalAxisRules(
                rules=tuple(self.config.logical_axis_rules.items()), tp_axis=self.tp_axis,
                state_axis=self.zero_axis, roles=tuple(self.roles().items())),
            rules_lib.LayerLayouts(rules=tuple(self.sharding_rules()),
                                   undeclared_replicated=self.tp_axis is None)]
        batch = self.batch_transforms()
        transforms += batch[:1] if self.data_parallel is not None else []
        if self.pipeline_parallel is not None:
            transforms += self.pipeline_parallel.layout_transforms()
        if self.zero is not None:
            transforms += self.zero.layout_transforms(axis=self.zero_axis)
        # (The params stay whole over the context axis, and MoE layers name their experts'
        # first dimension, which the axis binding puts on the expert axis, as it puts heads
        # on the TP axis: CP and EP split the batch.)
        transforms += batch[1:] if self.data_parallel is not None else batch
        transforms.append(layout_lib.DropUnitAxes())
        return transforms

    def batch_transforms(self) -> List[layout_lib.LayoutTransform]:
        """The transforms that split the batch: its rows over the data axis (and the ZeRO
        axis under HSDP), each row's sequence over the context axis, the rows over the expert
        axis too."""
        out: List[layout_lib.LayoutTransform] = []
        dp = self.config.data_parallel
        if dp is not None:
            out.append(batch_layout_lib.BatchRows(
                row_axes=(dp.axis, self.zero_axis) if self.hsdp else (dp.axis,),
                data_axis=dp.axis))
        if self.context_parallel is not None:
            out.append(SequenceSplit(axis=self.context_parallel.config.axis,
                                     order=self.context_parallel))
        if self.expert_parallel is not None:
            out.append(ExpertRows(axis=self.expert_parallel.config.axis))
        return out

    def batch_layout(self) -> batch_layout_lib.BatchLayout:
        """Where the batch lives on any mesh (the size-1 axes kept: the layout drops them):
        what the inputs place, before any param is known. Built once (every host batch's size
        check reads it)."""
        if self._batch_layout is None:
            layout = layout_lib.Layout(mesh_axes=(), parameter_specs=None)
            for transform in self.batch_transforms():
                layout = transform.apply(layout)
            self._batch_layout = layout.batch
        return self._batch_layout

    def layout(self, parameter_specs: Any, mesh: Mesh) -> layout_lib.Layout:
        """Where every param of ``parameter_specs`` (ParameterSpecs, arrays or
        ShapeDtypeStructs) and its optimizer state live on ``mesh`` under this plan."""
        return layout_lib.build_layout(self.layout_transforms(), mesh_shape=dict(mesh.shape),
                                       parameter_specs=parameter_specs,
                                       axis_binding=self.axis_binding())

    def axis_binding(self, *, logical_axis_rules: bool = True) -> AxisBinding:
        """Which mesh axis holds each logical dimension (parallel/axis_binding.py), built from
        the plan's parts: TP binds heads, kv heads, mlp and vocab (and, with sequence
        parallelism, the residual stream's sequence), CP a row's sequence, EP the experts, PP
        the stages; ``logical_axis_rules`` that map a name to the TP axis or to None override
        (those to the ZeRO / FSDP axis place the state split only: parallel/logical_axes.py)."""
        cfg = self.config
        dims: Dict[str, Optional[str]] = {}
        tp = cfg.tensor_parallel
        if tp is not None:
            dims.update({dim: tp.axis for dim in axis_binding_lib.TENSOR_PARALLEL_DIMS})
            if tp.sequence_parallel:
                dims[axis_binding_lib.RESIDUAL_SEQUENCE] = tp.axis
        if cfg.context_parallel is not None:
            dims[axis_binding_lib.SEQUENCE] = cfg.context_parallel.axis
        if cfg.expert_parallel is not None:
            dims[axis_binding_lib.EXPERTS] = cfg.expert_parallel.axis
        if cfg.pipeline_parallel is not None:
            dims[axis_binding_lib.STAGES] = cfg.pipeline_parallel.axis
        if logical_axis_rules:
            for name, axis in cfg.logical_axis_rules.items():
                if (axis is None or axis == self.tp_axis) and \
                        name not in axis_binding_lib.NOT_WEIGHT_DIMS:
                    dims[name] = axis
        return AxisBinding(
            dims=tuple(dims.items()),
            context_strategy=(cfg.context_parallel.strategy if cfg.context_parallel is not None
                              else "all_gather"),
            context_pieces=(1 if cfg.context_parallel is not None
                            and cfg.context_parallel.load_balance == "none" else 2))

    def check_hand_written_step(self, *, state_split: bool) -> None:
        """What a hand-written ``@step_fn`` (it sees whole params and applies its gradients to
        the whole state) cannot run under: a pipeline, a state ZeRO / FSDP split
        (``state_split``: the run's state-sharding strategy splits it)."""
        if self.pp_axis is not None:
            raise errors.PlanError(
                "a hand-written @step_fn cannot run a pipeline yet: it would see each stage's "
                "slice of the stacked layers", path="plan.pipeline_parallel",
                suggestion="train the configured model (fit() without a step function), or drop "
                           "pipeline_parallel")
        if state_split:
            raise errors.PlanError(
                "ZeRO / FSDP lay out and update the state inside the engine's model step; a "
                "hand-written @step_fn applies its gradients to the whole state itself",
                path="plan.zero", suggestion="drop plan.zero for this step, or configure a "
                "model and let the engine run its step")

    def check_whole_model_call(self, call: str, mesh: Mesh) -> None:
        """``call`` (``model.generate`` and the like: the whole stack on each device) refused on
        a pipelined layout, where each pipe rank holds a slice of the layer stack and only the
        pipeline schedule runs it."""
        if self.pp_axis is not None and mesh.shape[self.pp_axis] > 1:
            raise errors.PlanError(
                f"{call} cannot run on a pipelined layout (each pipe rank holds a slice of the "
                "layer stack)", path="plan.pipeline_parallel",
                suggestion="run it on a mesh without the pipe axis: checkpoints restore onto any "
                           "mesh (--config.plan.pipeline_parallel=None)")

    def check_model(self, model: Any, mesh: Mesh) -> None:
        """What the model cannot run under this plan on ``mesh``, refused before anything
        compiles: a split that no layer of it implements (a row's sequence without
        context-parallel attention, experts without a mixture of experts), then each layer's
        own refusals (``BaseLayer.check_axis_binding``: a layer checks the plan it is given,
        the mesh's sizes included)."""
        binding = dataclasses.replace(self.axis_binding(),
                                      mesh_shape=tuple(dict(mesh.shape).items()))
        implemented = model.implemented_dims()
        if binding.axis(axis_binding_lib.SEQUENCE) is not None \
                and axis_binding_lib.SEQUENCE not in implemented:
            raise errors.PlanError(
                "the plan splits each row's sequence over an axis, and the model has no "
                "attention layer that joins the pieces (context-parallel attention): each "
                "device would attend within its own chunk only (an adapted Flax module's "
                "attention among them)", path="plan.context_parallel",
                suggestion="use a Titanax decoder (its attention implements the CP strategies), "
                           "or drop context_parallel (--config.plan.context_parallel=None)")
        if binding.axis(axis_binding_lib.EXPERTS) is not None \
                and axis_binding_lib.EXPERTS not in implemented:
            raise errors.PlanError(
                "the plan splits experts over an axis, and the model has no mixture-of-experts "
                "layer", path="plan.expert_parallel",
                suggestion="give the model MoE layers (e.g. Decoder.Config.moe), or drop "
                           "expert_parallel (--config.plan.expert_parallel=None)")
        model.check_axis_binding(binding, path="model")

    def describe(self, params: Any, mesh: Mesh, *, specs: Any = None) -> str:
        """A table of every param: path, global shape, spec, local shape, bytes per device.

        ``specs``: the layouts to show (default: this plan's ``layout`` of ``params``; the
        engine passes its layout's, whose shapes and specs are the circular schedule's view)."""
        if specs is None:
            specs = self.layout(params, mesh).param_specs
        flat_params = sharding.flat_paths(params, is_leaf=rules_lib.is_param_leaf)
        flat_specs = sharding.flat_paths(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        mesh_shape = dict(mesh.shape)
        rows = []
        total_global = total_local = 0
        for path, leaf in flat_params.items():
            spec = flat_specs[path]
            shape = tuple(leaf.shape)
            local = rules_lib.local_shape(shape, spec, mesh_shape)
            itemsize = rules_lib.itemsize(leaf)
            global_bytes = _prod(shape) * itemsize
            local_bytes = _prod(local) * itemsize
            total_global += global_bytes
            total_local += local_bytes
            rows.append((path, str(shape), _spec_text(spec), str(local), bytes_text(local_bytes)))
        header = ("param", "global shape", "spec", "local shape", "bytes/device")
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
        roles = self.roles()
        axes_text = ", ".join(f"{a}={s}" + (f" ({roles[a]})" if a in roles else "")
                              for a, s in mesh_shape.items())
        lines = [f"plan over mesh {axes_text}; accumulate_steps={self.accumulate_steps}"
                 + (f"; ZeRO-{self.config.zero.stage}" if self.config.zero else ""),
                 "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.append(f"total: {len(rows)} params, {bytes_text(total_global)} global, "
                     f"{bytes_text(total_local)} per device")
        return "\n".join(lines)


def _maybe(cfg):
    return cfg.instantiate() if cfg is not None else None


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _spec_text(spec: PartitionSpec) -> str:
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


def bytes_text(count: float) -> str:
    """``1.5 MiB``: a byte count for tables."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{int(count)} B"
