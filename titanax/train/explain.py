"""``--explain``: the mesh, the layout pipeline and every param's layout, the schedule, the train
state per device, and every collective of the compiled step with the layer and pass it serves."""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np
from jax.sharding import Mesh

from titanax.observe import hlo, state_report
from titanax.parallel import expert_parallel
from titanax.parallel.layout import Layout
from titanax.parallel.plan import Plan
from titanax.runtime.mesh import describe_mesh
from titanax.train.state_sharding import StateSharding


def explain(*, mesh: Mesh, plan: Plan, layout: Optional[Layout], param_dtype: Any,
            strategy: Optional[StateSharding] = None, opt_state: Any = None,
            schedule_text: Optional[str] = None, compiled: Any = None,
            model: Any = None) -> str:
    """The report (each part only when there is something to show): ``opt_state`` the optimizer
    state as ShapeDtypeStructs with shardings; ``schedule_text`` the gradient computer's own
    lines (a pipeline's); ``compiled`` the compiled train step; ``model`` the model (its MoE
    layers under expert parallelism; its own ``explain_lines(gathers=...)`` when it has them:
    an adapted Flax module's variables, layer stacks and FSDP gathers)."""
    parts: List[str] = [describe_mesh(mesh)]
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
                                 layers=expert_parallel.moe_layers(model)))
    own_lines = getattr(model, "explain_lines", None)  # A model's own part (Flax adapters').
    if own_lines is not None:
        parts.append(own_lines(gathers=strategy.gathers if strategy is not None else None))
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
    return "\n\n".join(parts)
