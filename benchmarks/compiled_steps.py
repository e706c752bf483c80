"""The compiled train steps of every step_speed cell and of the parallel layouts, as text.

A refactor that should not change what runs proves it here: dump the steps before and after
(each checkout with its own code) and diff. Each step is compiled only (nothing runs), its HLO
written with the metadata stripped (source lines, op names: they move with any edit), so two
dumps differ exactly where the programs do.

    python benchmarks/compiled_steps.py --out /tmp/after            # this checkout
    git worktree add /tmp/before <rev> && cd /tmp/before && \
        PYTHONPATH=/tmp/before python /work/main/benchmarks/compiled_steps.py --out /tmp/before_hlo
    diff -r /tmp/before_hlo /tmp/after && echo identical
    python benchmarks/compiled_steps.py --compare /tmp/before_hlo /tmp/after

``--compare`` says, per step, "identical" (the same text), "same ops" (the same multiset of
instructions once instruction names, parameter numbers and the order of tuple elements are set
aside: params whose tree keys were renamed sort into another order) or how many differ.

Steps: the 24 cells of ``benchmarks/step_speed.py`` (small and large GPT, 8x1 / 4x2 / 2x4,
K=1/4, f32/bf16) and one step per parallel layout the tests train -- sequence parallelism, PP
(1F1B, GPipe, circular), FSDP, HSDP, CP (all-gather, ring, Ulysses), EP -- and per objective
(LoRA SFT, DPO with a frozen copy and with LoRA's base, GRPO without and with its KL), taken from
the registered experiments with their sizes.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import re
import sys
from typing import Any, Callable, Dict, List, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (experiment, overrides): the parallel layouts the tests train, at the experiments' sizes.
LAYOUTS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "tp_sp": ("gpt_tiny_dp_tp", {"plan.tensor_parallel.sequence_parallel": True}),
    "llama_tp_sp": ("llama_tiny_dp_tp", {"plan.tensor_parallel.sequence_parallel": True}),
    "pp_1f1b": ("gpt_tiny_pp", {}),
    "pp_gpipe": ("gpt_tiny_pp", {"plan.pipeline_parallel.schedule": "gpipe"}),
    "pp_tp": ("gpt_tiny_pp_tp", {}),
    "fsdp": ("gpt_tiny_fsdp", {}),
    "hsdp": ("gpt_tiny_hsdp", {}),
    "cp_all_gather": ("llama_tiny_cp", {}),
    "cp_ring": ("llama_tiny_cp", {"plan.context_parallel.strategy": "ring"}),
    "cp_ulysses": ("llama_tiny_cp", {"plan.context_parallel.strategy": "ulysses"}),
    "ep": ("moe_tiny_ep", {}),
    # The objectives and LoRA (wave 4), at their experiments' sizes: the batch is built from what
    # the train input's source declares (a GRPO run's: its rollout rows).
    "lora": ("llama_tiny_lora_sft", {}),
    "dpo": ("llama_tiny_dpo", {}),
    "dpo_lora": ("llama_tiny_dpo", {"lora.rank": 8}),
    "grpo": ("llama_tiny_grpo", {}),
    "grpo_kl": ("llama_tiny_grpo", {"OBJECTIVE.beta": 0.04}),
}


def strip_metadata(text: str) -> str:
    """HLO text without what moves with any source edit: metadata, the source file / function /
    stack-frame tables, and the module's name."""
    kept, skipping = [], False
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            skipping = True
        elif skipping and not line.strip():
            skipping = False
        elif not skipping:
            kept.append(line)
    text = "\n".join(kept) + "\n"
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r"^HloModule \S+", "HloModule step", text, flags=re.M)
    return text


def instruction_counts(text: str) -> collections.Counter:
    """The multiset of a program's instructions -- result type, opcode, attributes -- with the
    names of values and computations, parameter numbers and tuple order left out."""
    counts: collections.Counter = collections.Counter()
    for line in strip_metadata(text).splitlines():
        match = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = (\S+(?: \S+)*?) ([a-z][a-z0-9\-]*)\((.*)$",
                         line)
        if not match:
            continue
        result, opcode, rest = match.groups()
        rest = re.sub(r"%[\w.\-]+", "%", rest)
        rest = re.sub(r"(channel_id|index)=\d+", r"\1=N", rest)
        if opcode == "parameter":
            rest = "N)" + rest.split(")", 1)[1]
        result = re.sub(r"/\*index=\d+\*/", "", result)
        if result.startswith("("):
            result = "(" + ", ".join(sorted(re.split(r", (?![^{]*\})", result[1:-1]))) + ")"
        counts[(result, opcode, rest)] += 1
    return counts


def compare(before: str, after: str) -> None:
    """One line per step dumped in both directories."""
    for name in sorted(os.listdir(after)):
        if not name.endswith(".hlo") or not os.path.exists(os.path.join(before, name)):
            continue
        with open(os.path.join(before, name), encoding="utf-8") as f:
            old = strip_metadata(f.read())
        with open(os.path.join(after, name), encoding="utf-8") as f:
            new = strip_metadata(f.read())
        if old == new:
            print(f"{name[:-4]}: identical")
            continue
        a, b = instruction_counts(old), instruction_counts(new)
        print(f"{name[:-4]}: " + ("same ops" if a == b else
                                  f"differ ({sum((a - b).values())} instructions only before, "
                                  f"{sum((b - a).values())} only after)"))


def _compiled(engine: Any, batch: Any) -> Tuple[Any, Callable[[int], float]]:
    """The compiled step, and ``steps -> median ms`` of running it on ``batch``."""
    engine.init_state()
    placed = engine.inputs.placed(batch)
    compiled = engine.compile(example_batch=batch).compiled_for(engine.state, placed)
    return compiled, lambda steps: _median_step_ms(engine, compiled, placed, steps)


def _median_step_ms(engine: Any, compiled: Any, batch: Any, steps: int) -> float:
    """Median wall time of ``steps`` runs of the compiled step (after one warm-up)."""
    import statistics  # pylint: disable=import-outside-toplevel
    import time  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel
    times = []
    for index in range(steps + 1):
        started = time.perf_counter()
        engine.state, metrics = compiled(engine.state, batch)
        jax.block_until_ready((engine.state, metrics))
        if index:
            times.append(1e3 * (time.perf_counter() - started))
    return statistics.median(times)


def _cell_steps() -> List[Tuple[str, Callable[[], Any]]]:
    sys.path.insert(0, REPO_ROOT)
    from benchmarks import step_speed  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel

    steps = []
    for cell in step_speed._cells(quick=False):  # pylint: disable=protected-access
        sizes = step_speed.SHAPES[cell.shape]

        def build(cell=cell, sizes=sizes):
            model = step_speed.gpt_model_config().set(
                name="gpt", vocab_size=sizes["vocab_size"], max_seq_len=sizes["seq_len"],
                num_layers=sizes["num_layers"], model_dim=sizes["model_dim"],
                num_heads=sizes["num_heads"])
            engine = step_speed._engine(cell, model)  # pylint: disable=protected-access
            ids = np.random.default_rng(0).integers(
                0, sizes["vocab_size"], (sizes["batch_size"], sizes["seq_len"] + 1))
            batch = {"input_ids": ids[:, :-1].astype(np.int32),
                     "target_ids": ids[:, 1:].astype(np.int32)}
            return _compiled(engine, batch)

        steps.append((cell.label.replace(" ", "_").replace("=", ""), build))
    return steps


def _layout_steps() -> List[Tuple[str, Callable[[], Any]]]:
    import numpy as np  # pylint: disable=import-outside-toplevel
    from titanax.config import registry  # pylint: disable=import-outside-toplevel
    registry.load_config_modules(list(registry.DEFAULT_CONFIG_MODULES))

    steps = []
    for name, (experiment, overrides) in LAYOUTS.items():

        def build(experiment=experiment, overrides=overrides):
            cfg = registry.get_config(experiment).clone()
            for path, value in overrides.items():
                if path == "plan.tensor_parallel.sequence_parallel" and \
                        "sequence_parallel" not in cfg.plan.tensor_parallel.keys():
                    path = "model.sequence_parallel"  # (Where code before the binding had it.)
                if path.startswith("lora."):
                    cfg.set_recursively("lora", _lora_config())
                # (An objective's fields: under grpo / preference before wave 5.)
                path = path.replace("OBJECTIVE", _objective_field(cfg))
                cfg.set_recursively(path, value)
            cfg.loggers, cfg.evalers, cfg.checkpoint = [], {}, None
            engine = cfg.instantiate()
            return _compiled(engine, _layout_batch(cfg, np.random.default_rng(0)))

        steps.append((name, build))
    return steps


def _objective_field(cfg: Any) -> str:
    """Where the config keeps its objective: ``objective``, or (before wave 5) ``grpo`` /
    ``preference``."""
    if "objective" in cfg.keys():
        return "objective"
    return "grpo" if getattr(cfg, "grpo", None) is not None else "preference"


def _lora_config() -> Any:
    from titanax.modules.lora import LoRA  # pylint: disable=import-outside-toplevel
    return LoRA.default_config()


def _layout_batch(cfg: Any, rng: Any) -> Dict[str, Any]:
    """A train batch of the experiment's shape: the fields its source declares (ids below the
    vocabulary, weights 1 on the second half of each row), or a GRPO run's rollout rows."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    source = cfg.train_input.source
    rows = cfg.train_input.global_batch_size
    fields = dict(getattr(source.klass, "FIELDS", None) or {"input_ids": "int32",
                                                             "target_ids": "int32"})
    objective = getattr(cfg, _objective_field(cfg), None)
    per_row = ()
    if "prompt_ids" in fields:  # Prompts: the train step sees rollout rows.
        from titanax.rl import rows as rollout_rows  # pylint: disable=import-outside-toplevel
        fields = dict(rollout_rows.FIELDS)
        length = source.max_prompt_tokens + objective.max_new_tokens - 1
        rows = rows * objective.num_generations // objective.updates_per_rollout
        per_row = ("advantages", "row_weights")
    else:
        length = source.seq_len
    vocab = cfg.model.vocab_size or 256
    batch = {}
    for name, dtype in fields.items():
        shape = (rows,) if name in per_row else (rows, length)
        if name.endswith("segment_ids"):
            batch[name] = np.ones(shape, dtype)
        elif name.endswith("ids") or name == "positions":
            batch[name] = rng.integers(0, vocab if name.endswith("ids") else length,
                                       shape).astype(dtype)
        else:
            batch[name] = (np.ones(shape, dtype) if name in per_row else
                           (np.arange(length)[None, :] >= length // 2).repeat(rows, 0)
                           .astype(dtype))
    return batch


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="directory for <step>.hlo files")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                        help="compare two directories of dumps instead")
    parser.add_argument("--only", default="", help="comma-separated step names (default: all)")
    parser.add_argument("--time", type=int, default=0, metavar="STEPS",
                        help="also run each step STEPS times and print its median ms (a "
                             "before/after pair: run both checkouts alternately, twice)")
    args = parser.parse_args(argv)
    if args.compare:
        compare(*args.compare)
        return
    if not args.out:
        parser.error("--out (or --compare) is required")
    from titanax.runtime.cpu_devices import simulate_cpu_devices  # pylint: disable=import-outside-toplevel
    simulate_cpu_devices(8)
    os.makedirs(args.out, exist_ok=True)
    wanted = {n for n in args.only.split(",") if n}
    steps = (_cell_steps() if not wanted or wanted - set(LAYOUTS) else []) + _layout_steps()
    for name, build in steps:
        if wanted and name not in wanted:
            continue
        compiled, timed = build()
        text = strip_metadata(compiled.as_text())
        with open(os.path.join(args.out, f"{name}.hlo"), "w", encoding="utf-8") as f:
            f.write(text)
        timing = f"; median {timed(args.time):.1f} ms" if args.time else ""
        print(f"{name}: {hashlib.sha256(text.encode()).hexdigest()[:16]} "
              f"({len(text.splitlines())} lines){timing}", flush=True)


if __name__ == "__main__":
    main()
