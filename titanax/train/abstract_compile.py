"""``--compile_only``: the train step compiled for the configured mesh from shapes alone.

Whether a run fits its devices is a property of the compiled program: XLA's memory analysis of
the train step says how many bytes each device holds in arguments (params, optimizer state, the
batch), outputs, temporaries, and how much of the outputs reuses donated arguments. Here the step
is lowered from abstract values -- the state as ShapeDtypeStructs with the layout's shardings,
the batch as the shape the train input's source declares (its fields, ``seq_len`` and the global
batch size) -- so no param, optimizer state or batch is allocated and no data is read; on a CPU
host with ``--cpu_devices=N`` a 64-device run is sized before anyone rents the devices (as
MaxText's ``train_compile.py`` does for a target topology).
"""

from __future__ import annotations

from typing import Any, Dict

import jax
import numpy as np
from jax.sharding import NamedSharding

from titanax import errors
from titanax.observe import dot_operands

GIB = float(1 << 30)


def batch_template(engine: Any) -> Dict[str, jax.ShapeDtypeStruct]:
    """The global train batch as ShapeDtypeStructs placed as the layout splits it, from the
    train input's declarations (no example is read)."""
    input_cfg = engine.config.train_input
    source = getattr(input_cfg, "source", None) if input_cfg is not None else None
    fields = getattr(getattr(source, "klass", None), "FIELDS", None)
    length = getattr(source, "seq_len", None)
    rows = getattr(input_cfg, "global_batch_size", None)
    # The fields with one value per row (the rest: one per position).
    per_row = tuple(getattr(getattr(source, "klass", None), "PER_ROW", ()))
    declared = engine.objective.abstract_batch(engine)
    if declared is not None:  # (A sampling objective's rollout rows.)
        fields, length, rows, per_row = declared
    if fields is None or not isinstance(length, int) or not isinstance(rows, int):
        kind = getattr(getattr(source, "klass", None), "__name__", type(source).__name__)
        raise errors.LaunchFlagError(
            f"--compile_only builds the batch from what the train input declares, and its source "
            f"({kind}) declares no fields, seq_len or global_batch_size", path="train_input",
            suggestion="use a TextWindows or PackedDocuments source, or compile with --explain "
                       "(which reads the first batch)")
    host = {name: np.zeros((rows,) + ((length,) if name not in per_row else ()), dtype)
            for name, dtype in fields.items()}
    host = engine.inputs.batch.prepared(host, dict(engine.mesh.shape))
    specs = engine.steps.batch_specs(host)
    return jax.tree_util.tree_map(
        lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                             sharding=NamedSharding(engine.mesh, spec)),
        host, specs)


def compiled_from_shapes(engine: Any, *, state: Any, batch: Any) -> Any:
    """The train step compiled on ``state`` (ShapeDtypeStructs with the layout's shardings:
    no param allocated, no checkpoint read) and ``batch`` (arrays or ShapeDtypeStructs): what
    ``--compile_only`` sizes and ``--explain`` prints."""
    return lowered_from_shapes(engine, state=state, batch=batch).compile()


def lowered_from_shapes(engine: Any, *, state: Any, batch: Any) -> Any:
    """The train step lowered (StableHLO, what XLA is handed) on ``state`` and ``batch``, as
    ``compiled_from_shapes``."""
    step = engine.steps.train_step(None, engine.states.state_specs())
    return step.lower(state, batch)


def compile_only(engine: Any) -> Dict[str, int]:
    """Per-device bytes of the compiled train step: temp, arguments, outputs, aliased, and the
    peak (arguments + outputs + temp - aliased)."""
    engine.build()
    state = engine.state_template()
    lowered = lowered_from_shapes(engine, state=state, batch=batch_template(engine))
    compiled = lowered.compile()
    analysis = compiled.memory_analysis()
    report = {
        "temp_bytes": int(analysis.temp_size_in_bytes),
        "argument_bytes": int(analysis.argument_size_in_bytes),
        "output_bytes": int(analysis.output_size_in_bytes),
        "alias_bytes": int(analysis.alias_size_in_bytes),
    }
    report["peak_bytes"] = (report["argument_bytes"] + report["output_bytes"]
                            + report["temp_bytes"] - report["alias_bytes"])
    if engine.precision.config.fp8:
        report["float8_dots"], report["dots"] = dot_operands.float8_dots(lowered.as_text())
    extra = engine.objective.compile_report(engine, state=state,
                                            train_arguments=report["argument_bytes"])
    report.update(extra)
    if "rollout_peak_bytes" in extra:
        report["peak_bytes"] = max(report["peak_bytes"], extra["rollout_peak_bytes"])
    return report


def describe(report: Dict[str, int], *, mesh: Any) -> str:
    """Lines for a person, ahead of the JSON line."""
    devices = int(np.prod(list(dict(mesh.shape).values())))
    shape = " x ".join(f"{axis} {size}" for axis, size in dict(mesh.shape).items())
    return "\n".join([
        f"compiled the train step for {devices} devices ({shape}); per device:",
        *(f"  {name[:-6]:>8}: {report[name] / GIB:9.3f} GiB" for name in
          ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "peak_bytes")),
        *([f"  float8: {report['float8_dots']} of the step's {report['dots']} dots take float8 "
           "operands as XLA is handed them (XLA:CPU upcasts them after its optimizations; a GPU "
           "keeps them)"] if "float8_dots" in report else []),
        *([f"  the rollout (the sampler's temp {report['sampler_temp_bytes'] / GIB:.3f} GiB "
           f"and outputs on top of the train state): {report['rollout_peak_bytes'] / GIB:.3f} "
           "GiB"] if "rollout_peak_bytes" in report and "decode_pool_bytes" not in report
          else []),
        *([f"  the rollout (the decode engine's pool of {report['decode_pool_tokens']} tokens "
           f"per batch shard, {report['decode_pool_bytes'] / GIB:.3f} GiB, and its decode "
           f"chunk's temp {report['sampler_temp_bytes'] / GIB:.3f} GiB on top of the train "
           f"state): {report['rollout_peak_bytes'] / GIB:.3f} GiB"]
          if "decode_pool_bytes" in report else [])])
