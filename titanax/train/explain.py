"""``--explain``: the mesh, the layout pipeline and every param's layout, the schedule, the train
state per device, and every collective of the compiled step with the layer and pass it serves."""

from __future__ import annotations

from typing import Any, List, Optional

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from titanax.modules.layers import moe
from titanax.observe import hlo, state_report
from titanax.parallel import sharding
from titanax.parallel.layout import Layout
from titanax.parallel.plan import Plan
from titanax.runtime import slices
from titanax.runtime.mesh import describe_mesh
from titanax.train.state_sharding import StateSharding


def explain(*, mesh: Mesh, plan: Plan, layout: Optional[Layout], param_dtype: Any,
            strategy: Optional[StateSharding] = None, opt_state: Any = None,
            schedule_text: Optional[str] = None, compiled: Any = None,
            model: Any = None, optimizer_text: Optional[str] = None, slice_count: int = 1
            ) -> str:
    """The report (each part only when there is something to show): ``opt_state`` the optimizer
    state as ShapeDtypeStructs with shardings; ``schedule_text`` the gradient computer's own
    lines (a pipeline's); ``compiled`` the compiled train step; ``model`` the model (its MoE
    layers under expert parallelism; its own ``explain_lines(gathers=...)`` when it has them:
    an adapted Flax module's variables, layer stacks and FSDP gathers); ``optimizer_text`` the
    optimizer's own lines (Muon's matrices and their gathers); ``slice_count`` the slices the
    mesh spans (multi-slice: which collectives cross DCN)."""
    parts: List[str] = [describe_mesh(mesh, slices=slice_count)]
    if layout is not None:
        parts.append(plan.describe(layout.parameter_specs, mesh, specs=layout.param_specs)
                     + "\nlayout pipeline: " + " -> ".join(layout.history)
                     + ("\naxis binding: " + layout.axis_binding.describe()
                        if layout.axis_binding is not None else ""))
    if schedule_text:
        parts.append(schedule_text)
    cp = plan.context_parallel
    if cp is not None:
        parts.append(cp.describe(size=dict(mesh.shape)[cp.config.axis],
                                 length=cp.sequence_length))
    ep = plan.expert_parallel
    if ep is not None and model is not None:
        parts.append(ep.describe(size=dict(mesh.shape)[ep.config.axis],
                                 layers=moe.moe_layers(model)))
    own_lines = getattr(model, "explain_lines", None)  # A model's own part (Flax adapters').
    if own_lines is not None:
        parts.append(own_lines(gathers=strategy.gathers if strategy is not None else None))
    if optimizer_text:
        parts.append(optimizer_text)
    if layout is not None and strategy is not None and opt_state is not None:
        parts.append(state_report.describe(
            parameter_specs=layout.parameter_specs, param_specs=layout.param_specs,
            grad_specs=strategy.grad_specs, opt_state=opt_state, mesh_shape=layout.mesh_shape,
            itemsize=np.dtype(param_dtype).itemsize, title=strategy.title,
            axis=strategy.shard_axis, dims=strategy.dims, gathers=strategy.gathers,
            trainable=strategy.trainable))
    if compiled is not None:
        ops = hlo.collectives_report(compiled.as_text(), mesh)
        parts.append("collectives of the train step:\n" + hlo.format_report(ops) + "\n"
                     + hlo.format_totals_by_axis(ops))
        if slice_count > 1:
            parts.append(_across_slices(ops, mesh, slice_count))
    return "\n\n".join(parts)


def _across_slices(ops: List[hlo.CollectiveOp], mesh: Mesh, slice_count: int) -> str:
    """The collectives that cross slices (over DCN), by axes and op, with their bytes."""
    grid = slices.slice_grid(mesh.devices, slices=slice_count)
    names = list(mesh.axis_names)
    crossing = [op for op in ops
                if not op.axes or slices.crosses(grid, [names.index(a) for a in op.axes])]
    if not crossing:
        return f"across the {slice_count} slices (DCN): no collective"
    lines = [f"across the {slice_count} slices (DCN), per device per call "
             f"({len(crossing)} of the step's {len(ops)} collectives):"]
    totals = {}
    for op in crossing:
        entry = totals.setdefault((",".join(op.axes) or "?", op.op, op.layer or op.pass_name),
                                  [0, 0])
        entry[0] += 1
        entry[1] += op.bytes
    for (axes, kind, where), (count, size) in sorted(totals.items()):
        lines.append(f"  {axes}: {count} x {kind} ({where or '?'}), {size} bytes")
    return "\n".join(lines)


def explain_engine(engine: Any, *, compiled: Any = None, local_batch: Optional[int] = None
                   ) -> str:
    """``explain`` of a built Engine: its schedule (the gradient computer's, the reducer's and
    the objective's lines) and its compiled train step -- ``compiled`` (with ``local_batch``
    rows per batch shard) or the engine's own when there is one."""
    if compiled is None:
        train_step = engine.compiled_train_step()
        compiled = train_step.latest if train_step is not None else None
        local_batch = engine._local_batch_rows  # pylint: disable=protected-access
    schedule = None
    if engine.model is not None:
        analysis = compiled.memory_analysis() if compiled is not None else None
        schedule = engine.steps.setup.gradients.describe(
            layout=engine.layout, local_batch=local_batch,
            itemsize=np.dtype(engine.precision.param_dtype).itemsize,
            temp_bytes=getattr(analysis, "temp_size_in_bytes", None) if analysis else None)
        paths = [sharding.path_string(path) for path, _ in jax.tree_util.tree_flatten_with_path(
            engine.layout.param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]]
        schedule = "\n".join(t for t in (schedule, engine.steps.setup.reducer.describe(
            paths=paths), engine.objective.describe()) if t)
    return explain(
        mesh=engine.mesh, plan=engine.plan, layout=engine.layout,
        param_dtype=engine.precision.param_dtype,
        strategy=engine.states.strategy if engine.model is not None else None,
        opt_state=engine.state_template().opt_state if engine.model is not None else None,
        schedule_text=schedule, compiled=compiled, model=engine.model,
        optimizer_text=engine.steps.adapter.description if engine.model is not None
        else None, slice_count=engine.config.mesh.instantiate().slice_count())
