"""Titanax's Engine step vs the same GPT written independently (benchmarks/peers/).

Three implementations train the same model from the same numbers (the peers' first losses match
Titanax's, tests/benchmarks/test_peers.py): Titanax's Engine (the compiled step the launcher
runs), a Flax NNX model under ``jit`` with NamedSharding (GSPMD chooses the collectives) and plain
JAX under ``shard_map`` with one gradient reduction. For every cell (shape x mesh x
accumulate_steps x dtype) each is compiled once, then timed in interleaved rounds (the order
rotates every round; this machine is shared and noisy): the figure of merit is the median over
rounds of the *paired* per-round ratio Titanax / peer, so drift in machine speed cancels.

Also reported per implementation: the compiled step's temp bytes (XLA memory analysis), compile
seconds, and its collectives (count, and data-axis all-reduces). On the data-parallel cells an
extra row times the Flax peer's own NNX GPT trained through Titanax's ``FlaxNNX`` adapter against
that same NNX model under plain ``jit`` (``adapter/flax``).

    python benchmarks/step_speed.py --quick           # 4x2 and 8x1, K=1/4, f32/bf16: ~5 min
    python benchmarks/step_speed.py                   # + 2x4 and a larger shape
    python benchmarks/step_speed.py --variants scan,unroll   # Titanax's layer-stack modes too

Writes ``<out>/step_speed.json`` and ``<out>/step_speed.png`` (default out: benchmarks/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

# name -> GPT sizes. "small" is the shape of the table; "large" is 4x wider.
SHAPES = {
    "small": dict(num_layers=4, model_dim=128, num_heads=4, vocab_size=256, seq_len=64,
                  batch_size=32),
    "large": dict(num_layers=4, model_dim=512, num_heads=8, vocab_size=1024, seq_len=128,
                  batch_size=32),
}
# Titanax's variants: name -> (the layer stack's unroll, the plan's logical_axis_rules).
VARIANTS = {"default": (None, None), "scan": (False, None), "unroll": (True, None),
            # The embedding and head whole on every TP rank (no vocabulary-parallel loss).
            "vocab_whole": (None, {"vocab": None})}
LEARNING_RATE = 1e-3
WEIGHT_DECAY = 0.1


@dataclasses.dataclass(frozen=True)
class Cell:
    shape: str
    data: int
    model: int
    accumulate: int
    dtype: str

    @property
    def label(self) -> str:
        return f"{self.shape} {self.data}x{self.model} K={self.accumulate} {self.dtype}"


@dataclasses.dataclass
class Runner:
    """One implementation of one cell, ready to time."""

    name: str
    step: Callable[[], None]          # Runs one step (updates its own state).
    block: Callable[[], None]         # Waits for the last step.
    compiled: Any                     # The compiled executable (memory analysis, HLO).
    compile_seconds: float
    first_loss: float


def _titanax_runner(cell: Cell, batch_host: Dict[str, Any], *, unroll: Optional[bool],
                    name: str, rules: Optional[Dict[str, Any]] = None):
    import jax

    sizes = SHAPES[cell.shape]
    model = gpt_model_config().set(
        name="gpt", vocab_size=sizes["vocab_size"], max_seq_len=sizes["seq_len"],
        num_layers=sizes["num_layers"], model_dim=sizes["model_dim"],
        num_heads=sizes["num_heads"])
    if unroll is not None:
        model.unroll_layers = unroll
    engine = _engine(cell, model, rules=rules)
    engine.init_state()
    params = jax.tree_util.tree_map(lambda x: jax.device_get(x), engine.state.params)
    return params, _engine_runner(engine, batch_host, name=name)


def gpt_model_config() -> Any:
    """GPT-2's model config, from this checkout or an older one (before_after.py runs both):
    the decoder family's GPT-2 configuration, or the GPT class it replaced."""
    try:
        from titanax.modules.models.decoder import gpt_config  # pylint: disable=import-outside-toplevel
    except ImportError:  # Before GPT-2 became a configuration of the decoder.
        from titanax.modules.models.gpt import GPT  # pylint: disable=import-outside-toplevel
        return GPT.default_config()
    return gpt_config()


def _engine(cell: Cell, model: Any, *, rules: Optional[Dict[str, Any]] = None):
    """The Engine of ``cell`` (its mesh, plan, optimizer and dtype) around ``model``."""
    from titanax.config import config_for_function
    from titanax.parallel.plan import DP, TP, Plan
    from titanax.runtime.mesh import MeshSpec
    from titanax.train import optimizers
    from titanax.train.engine import Engine
    from titanax.train.learner import Learner
    from titanax.train.precision import Precision

    tp = cell.model > 1
    return Engine.default_config().set(
        mesh=MeshSpec.default_config().set(
            axes=("data", "model") if tp else ("data",),
            shape=(cell.data, cell.model) if tp else (cell.data,),
            devices=list(range(cell.data * cell.model))),
        plan=Plan.default_config().set(
            data_parallel=DP.default_config().set(accumulate_steps=cell.accumulate),
            tensor_parallel=TP.default_config() if tp else None,
            logical_axis_rules=dict(rules or {})),
        model=model,
        learner=Learner.default_config().set(optimizer=config_for_function(optimizers.adamw).set(
            learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY)),
        precision=Precision.default_config().set(bfloat16=cell.dtype == "bf16",
                                                 enable_x32_params=True),
        loggers=[]).instantiate()


def _engine_runner(engine, batch_host: Dict[str, Any], *, name: str) -> Runner:
    """An Engine's compiled train step on ``batch_host``, compiled (and timed) and run once."""
    import jax

    batch = engine.global_batch(batch_host)
    started = time.perf_counter()
    compiled_step = engine.compile(example_batch=batch)
    seconds = time.perf_counter() - started
    holder = {}

    def step():
        engine.state, holder["metrics"] = compiled_step(engine.state, batch)

    step()
    return Runner(name=name, step=step, block=lambda: jax.block_until_ready(engine.state),
                  compiled=compiled_step.latest, compile_seconds=seconds,
                  first_loss=float(holder["metrics"]["loss"]))


def peer_nnx_gpt(*, sizes: Any, compute_dtype: str, rngs: Any) -> Any:
    """The Flax peer's own NNX GPT (benchmarks/peers/flax_gpt.py), as a FlaxNNX factory."""
    import jax.numpy as jnp
    from benchmarks.peers import flax_gpt
    return flax_gpt.GPT(sizes, dtype=jnp.dtype(compute_dtype), rngs=rngs)


def _nnx_adapter_runner(cell: Cell, batch_host: Dict[str, Any], params) -> Runner:
    """The Flax peer's NNX GPT through Titanax's FlaxNNX adapter, from the same numbers: the
    Engine's step (explicit shard_map, one gradient reduction) around a model Titanax did not
    write. Data parallel only (the module calls no collectives)."""
    from benchmarks.peers import common, convert
    from titanax.config import config_for_function
    from titanax.modules.adapters.flax_nnx import FlaxNNX
    from titanax.modules.adapters.objectives import ReturnedLoss

    sizes = SHAPES[cell.shape]
    model = FlaxNNX.default_config().set(
        name="nnx_gpt",
        module=config_for_function(peer_nnx_gpt).set(
            sizes=common.GPTSizes.of_titanax(params),
            compute_dtype="bfloat16" if cell.dtype == "bf16" else "float32"),
        inputs=("input_ids", "target_ids"),
        example_inputs={"input_ids": f"int32[2,{sizes['seq_len']}]",
                        "target_ids": f"int32[2,{sizes['seq_len']}]"},
        loss=ReturnedLoss.default_config())
    engine = _engine(cell, model)  # Data parallel: the module calls no collectives.
    engine.init_state(params=convert.titanax_to_flax(params))
    return _engine_runner(engine, batch_host, name="titanax_nnx")


def _peer_runner(name: str, module, cell: Cell, params, batch_host) -> Runner:
    import jax
    import jax.numpy as jnp
    from benchmarks.peers import common

    mesh = jax.make_mesh((cell.data, cell.model), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:cell.data * cell.model])
    state, step_fn = module.build(params, mesh=mesh, accumulate_steps=cell.accumulate,
                                  dtype=jnp.bfloat16 if cell.dtype == "bf16" else jnp.float32,
                                  learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    batch = common.place_batch(batch_host, mesh=mesh)
    started = time.perf_counter()
    compiled = step_fn.jitted.lower(state, {k: batch[k] for k in common.BATCH_KEYS}).compile()
    seconds = time.perf_counter() - started
    holder = {"state": state}

    def step():
        holder["state"], holder["loss"] = step_fn(holder["state"], batch)

    step()
    return Runner(name=name, step=step, block=lambda: jax.block_until_ready(holder["state"]),
                  compiled=compiled, compile_seconds=seconds, first_loss=float(holder["loss"]))


def _collectives(compiled, mesh_shape: Dict[str, int]) -> Dict[str, int]:
    import jax
    import numpy as np
    from titanax.observe import hlo

    devices = np.asarray(jax.devices()[:int(np.prod(list(mesh_shape.values())))])
    mesh = jax.sharding.Mesh(devices.reshape(tuple(mesh_shape.values())), tuple(mesh_shape))
    ops = hlo.collectives_report(compiled.as_text(), mesh)
    return {"total": len(ops),
            "data_all_reduces": sum(1 for op in ops if op.op == "all-reduce"
                                    and "data" in op.axes),
            "inside_loops": sum(1 for op in ops if op.in_loop)}


def _time_cell(cell: Cell, *, rounds: int, steps: int, variants: List[str]) -> Dict[str, Any]:
    import jax
    from benchmarks.peers import flax_gpt, plain_jax_gpt
    from tests.train.helpers import text_batches

    sizes = SHAPES[cell.shape]
    batch_host = text_batches(batch_size=sizes["batch_size"], seq_len=sizes["seq_len"],
                              count=1)[0]
    if sizes["vocab_size"] > 256:  # Byte ids fit any vocabulary; spread them over it.
        batch_host = {k: (v * (sizes["vocab_size"] // 256)) for k, v in batch_host.items()}
    runners: List[Runner] = []
    params = None
    for variant in variants:
        unroll, rules = VARIANTS[variant]
        name = "titanax" if variant == "default" else f"titanax_{variant}"
        params, runner = _titanax_runner(cell, batch_host, unroll=unroll, name=name,
                                         rules=rules)
        runners.append(runner)
    runners.append(_peer_runner("flax", flax_gpt, cell, params, batch_host))
    runners.append(_peer_runner("plain_jax", plain_jax_gpt, cell, params, batch_host))
    if cell.model == 1:  # The adapted NNX model runs data parallel only.
        runners.append(_nnx_adapter_runner(cell, batch_host, params))
    times: Dict[str, List[float]] = {r.name: [] for r in runners}
    for round_index in range(rounds):
        order = runners[round_index % len(runners):] + runners[:round_index % len(runners)]
        for runner in order:
            runner.block()
            started = time.perf_counter()
            for _ in range(steps):
                runner.step()
            runner.block()
            times[runner.name].append((time.perf_counter() - started) / steps)
    mesh_shape = {"data": cell.data, "model": cell.model}
    result: Dict[str, Any] = {"cell": dataclasses.asdict(cell), "impls": {}}
    for runner in runners:
        memory = runner.compiled.memory_analysis()
        result["impls"][runner.name] = {
            "median_step_ms": 1e3 * statistics.median(times[runner.name]),
            "step_ms_per_round": [1e3 * t for t in times[runner.name]],
            "temp_bytes": int(getattr(memory, "temp_size_in_bytes", 0)) if memory else None,
            "compile_s": runner.compile_seconds,
            "first_loss": runner.first_loss,
            "collectives": _collectives(runner.compiled, mesh_shape),
        }
    titanax_times = times["titanax" if "default" in variants else runners[0].name]
    for peer in ("flax", "plain_jax"):
        ratios = [t / p for t, p in zip(titanax_times, times[peer])]
        result[f"ratio_vs_{peer}"] = statistics.median(ratios)
    if "titanax_nnx" in times:  # The adapter against the same NNX model under plain jit.
        result["nnx_adapter_vs_flax"] = statistics.median(
            [a / f for a, f in zip(times["titanax_nnx"], times["flax"])])
    result["ratio_vs_faster_peer"] = statistics.median(
        [t / min(f, p) for t, f, p in zip(titanax_times, times["flax"], times["plain_jax"])])
    impls = result["impls"]
    own = impls["titanax" if "default" in variants else runners[0].name]
    faster = min(("flax", "plain_jax"), key=lambda n: impls[n]["median_step_ms"])
    result["temp_ratio_vs_faster_peer"] = (own["temp_bytes"] / impls[faster]["temp_bytes"]
                                           if impls[faster]["temp_bytes"] else None)
    del jax
    return result


def _cells(quick: bool) -> List[Cell]:
    shapes = ["small"] if quick else ["small", "large"]
    meshes = [(4, 2), (8, 1)] if quick else [(8, 1), (4, 2), (2, 4)]
    return [Cell(shape, data, model, k, dtype) for shape in shapes for data, model in meshes
            for k in (1, 4) for dtype in ("f32", "bf16")]


def _print_table(results: List[Dict[str, Any]], variants: List[str]) -> None:
    extra = [f"titanax_{v}" for v in variants if v != "default"]
    header = (["cell", "titanax ms"] + [f"{v} ms" for v in extra]
              + ["flax ms", "plain ms", "/flax", "/plain", "/faster", "temp/faster",
                 "data AR (t/f/p)"])
    print(" | ".join(header))
    for r in results:
        impls = r["impls"]
        name = "titanax" if "titanax" in impls else next(iter(impls))
        row = [Cell(**r["cell"]).label, f"{impls[name]['median_step_ms']:.1f}"]
        row += [f"{impls[e]['median_step_ms']:.1f}" for e in extra]
        row += [f"{impls['flax']['median_step_ms']:.1f}", f"{impls['plain_jax']['median_step_ms']:.1f}",
                f"{r['ratio_vs_flax']:.2f}", f"{r['ratio_vs_plain_jax']:.2f}",
                f"{r['ratio_vs_faster_peer']:.2f}",
                f"{r['temp_ratio_vs_faster_peer']:.2f}" if r["temp_ratio_vs_faster_peer"] else "-",
                "/".join(str(impls[n]["collectives"]["data_all_reduces"])
                         for n in (name, "flax", "plain_jax"))]
        print(" | ".join(row), flush=True)


def _print_adapter_rows(results: List[Dict[str, Any]]) -> None:
    """The extra rows: the Flax peer's NNX GPT through FlaxNNX (Titanax's step) against the
    same NNX model under plain jit (GSPMD)."""
    rows = [r for r in results if "nnx_adapter_vs_flax" in r]
    if not rows:
        return
    print("\nFlaxNNX adapter: the Flax peer's NNX GPT in Titanax's step vs the same model under "
          "plain jit")
    print(" | ".join(["cell", "adapter ms", "flax ms", "adapter/flax", "first loss (a/f)",
                      "data AR (a/f)"]))
    for r in rows:
        impls = r["impls"]
        adapter, flax = impls["titanax_nnx"], impls["flax"]
        print(" | ".join([Cell(**r["cell"]).label, f"{adapter['median_step_ms']:.1f}",
                          f"{flax['median_step_ms']:.1f}", f"{r['nnx_adapter_vs_flax']:.2f}",
                          f"{adapter['first_loss']:.4f}/{flax['first_loss']:.4f}",
                          f"{adapter['collectives']['data_all_reduces']}/"
                          f"{flax['collectives']['data_all_reduces']}"]), flush=True)


def _plot(results: List[Dict[str, Any]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [Cell(**r["cell"]).label for r in results]
    figure, axis = plt.subplots(figsize=(max(6, 0.9 * len(labels)), 4))
    width = 0.4
    xs = range(len(labels))
    axis.bar([x - width / 2 for x in xs], [r["ratio_vs_flax"] for r in results], width,
             label="Titanax / Flax (GSPMD)")
    axis.bar([x + width / 2 for x in xs], [r["ratio_vs_plain_jax"] for r in results], width,
             label="Titanax / plain JAX (shard_map)")
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks(list(xs), labels, rotation=45, ha="right", fontsize=8)
    axis.set_ylabel("paired median step-time ratio (lower is faster)")
    axis.set_title("Titanax Engine step vs independent peers, 8 simulated CPU devices")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="small shape, meshes 4x2 and 8x1 only (about 5 minutes)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per cell")
    parser.add_argument("--steps", type=int, default=None, help="steps per round")
    parser.add_argument("--variants", default="default",
                        help="Titanax variants (comma separated): " + ", ".join(VARIANTS))
    parser.add_argument("--only", default=None, help="run only cells whose label contains this")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "benchmarks", "results"))
    args = parser.parse_args(argv)

    from titanax.runtime.cpu_devices import simulate_cpu_devices
    simulate_cpu_devices(8)
    rounds = args.rounds or (5 if args.quick else 7)
    steps = args.steps or (4 if args.quick else 6)
    variants = args.variants.split(",")
    cells = [c for c in _cells(args.quick) if not args.only or args.only in c.label]
    results = []
    started = time.perf_counter()
    for cell in cells:
        results.append(_time_cell(cell, rounds=rounds, steps=steps, variants=variants))
        print(f"# {cell.label}: done after {time.perf_counter() - started:.0f}s", flush=True)
    _print_table(results, variants)
    _print_adapter_rows(results)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "step_speed.json"), "w", encoding="utf-8") as f:
        json.dump({"rounds": rounds, "steps": steps, "results": results}, f, indent=1)
    _plot(results, os.path.join(args.out, "step_speed.png"))
    worst = max(r["ratio_vs_faster_peer"] for r in results)
    print(f"worst Titanax / faster peer: {worst:.2f}; written to {args.out}")


if __name__ == "__main__":
    main()
