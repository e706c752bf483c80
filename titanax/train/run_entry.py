"""What ``python -m titanax.launch`` runs for an Engine: train, evaluate, report -- or explain.

The launcher has joined the job (several processes) and validated the config; here the run is
built, its inputs checked against the plan, and then either the train step is compiled on the
first batch and ``explain()`` printed (``--explain``), or the run trains to ``max_steps``, runs
every evaler once more at the end and says where it stands.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Optional, Tuple

import jax

from titanax import errors
from titanax.observe import goodput
from titanax.runtime.mesh import describe_mesh
from titanax.train import abstract_compile, preemption
from titanax.train import explain as explain_lib


def run(engine: Any, *, trainer_dir: Optional[str] = None, cluster=None, explain: bool = False,
        compile_only: bool = False, on_start: Optional[Callable[[], None]] = None) -> int:
    """``on_start`` is called (on process 0) once everything was checked and the run really
    starts: the launcher writes the run's config record there."""
    from titanax.runtime import distributed  # pylint: disable=import-outside-toplevel
    if cluster is not None and cluster.is_multi_process:  # (The launcher has joined.)
        distributed.initialize(spec=cluster)
    engine.trainer_dir = trainer_dir or engine.trainer_dir
    engine.build()
    if engine.model is None:
        raise errors.StepError(
            "this experiment has no model, so the launcher has nothing to train", path="model",
            suggestion="set model in the experiment's Engine config (e.g. gpt_config() "
                       "or MLPClassifier.default_config()); to train a hand-written @step_fn, "
                       "call engine.fit(step_fn, data=...) from a script")
    engine.check_inputs()  # (From declarations: no example is read.)
    if compile_only:  # Shapes only: nothing allocated, no data read, nothing written.
        report = abstract_compile.compile_only(engine)
        print(abstract_compile.describe(report, mesh=engine.mesh), flush=True)
        print(json.dumps(report), flush=True)
        return 0
    preemption.exit_if_requested("while the run was built")
    if explain:
        compiled, local_batch = _explained_step(engine)
        engine.prepare_evaluation()  # (What the held-out data cuts or leaves unscored.)
        if on_start is not None and jax.process_index() == 0:
            on_start()
        print(explain_lib.explain_engine(engine, compiled=compiled, local_batch=local_batch),
              flush=True)
        return 0
    slice_count = engine.config.mesh.instantiate().slice_count()
    print(describe_mesh(engine.mesh, slices=slice_count).splitlines()[0], flush=True)
    started = time.perf_counter()
    engine.fit(on_start=on_start)
    _report_end(engine, time.perf_counter() - started)
    engine.close()
    return 0


def _explained_step(engine: Any) -> Tuple[Any, Optional[int]]:
    """``--explain``'s train step, compiled on the first batch's shapes; ``(compiled, rows per
    batch shard)``. Shapes are all it needs: the state is abstract (no param allocated -- a
    671B model explains on a CPU host as it compiles), no checkpoint is read. A sampling
    objective's first batch is a rollout, which needs params: it gets fresh ones (and shows or
    writes no sample)."""
    if engine.objective.abstract_batch(engine) is not None:
        engine.init_state()
        engine.records_samples = False
        engine.compile(example_batch=engine.first_train_batch())
        return engine.compiled_train_step().latest, None
    batch = engine.inputs.placed(engine.first_train_batch())
    engine.steps.check_batch(batch)
    compiled = abstract_compile.compiled_from_shapes(engine, state=engine.state_template(),
                                                     batch=batch)
    rows = jax.tree_util.tree_leaves(batch)[0].shape[0] // engine.plan.batch_shards(engine.mesh)
    return compiled, rows


def _report_end(engine: Any, seconds: float) -> None:
    step = int(jax.device_get(engine.state.step))
    evaluation = engine.evaluation
    results = (evaluation.last_results if evaluation.last_step == step
               else engine.run_evalers(step, only_due=False))
    for name, metrics in results.items():
        text = "  ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
        print(f"final {name}: {text}", flush=True)
    compiled = engine.compiled_train_step()
    if compiled is None:
        ckpt = engine.checkpointer()
        where = ckpt.directory if ckpt else "this run"
        print(f"nothing to train: the run in {where} is already at step {step} (max_steps "
              f"{engine.config.max_steps}). To train it further raise --config.max_steps; to "
              "start a new run use another --trainer_dir (or --config.checkpoint.resume=never "
              "--config.checkpoint.overwrite=true, which moves the old checkpoints aside)",
              flush=True)
    else:
        print(f"trained to step {step} of {engine.config.max_steps} in {seconds:.1f}s "
              f"(train-step compile {sum(compiled.compile_seconds):.1f}s)", flush=True)
        print(goodput.CLOCK.summary(), flush=True)
    goodput.CLOCK.write()
