"""Does the input keep up? Packed rows per second from JSONL and from ArrayRecord, against the
train step's tokens per second, measured side by side in one run (``llama_tiny_packed``'s shapes
on 8 simulated CPU devices).

    python benchmarks/input_speed.py [--batches 200] [--steps 30]

Prints, for each source: the time to build it (read, tokenize and pack -- once per run; for
ArrayRecord, open the shards), then rows/s and tokens/s of the whole pipeline (shuffle, batch,
read, prefetch) and its ratio to the train step's tokens/s. A ratio above 1 means the input is
not the bottleneck (it runs on other threads while the step computes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)


def _corpus(directory: str, documents: int = 20000) -> str:
    """A JSONL corpus of the bundled plays' paragraphs (repeated up to ``documents``)."""
    from titanax.data.documents import read_documents
    from titanax.data.train_tokenizer import corpus_files
    texts = [d.text for d in read_documents(corpus_files(), fields=("text",))]
    path = os.path.join(directory, "plays.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for i in range(documents):
            f.write(json.dumps({"text": texts[i % len(texts)]}) + "\n")
    return path


def _pipeline_speed(input_cfg, source, batches: int):
    from titanax.data.pipeline import Input
    made = Input(input_cfg, source=source)
    iterator = iter(made)
    next(iterator)  # Threads started, first batch read.
    started = time.perf_counter()
    for _ in range(batches):
        batch = next(iterator)
    seconds = time.perf_counter() - started
    rows = batches * batch["input_ids"].shape[0]
    return rows / seconds, rows * batch["input_ids"].shape[1] / seconds


def _step_speed(engine, batch, steps: int) -> float:
    import jax
    placed = engine.global_batch(batch)
    step = engine.compile(example_batch=placed)
    for _ in range(3):
        engine.state, _ = step(engine.state, placed)
    jax.block_until_ready(engine.state)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.state, _ = step(engine.state, placed)
        jax.block_until_ready(engine.state)
        times.append(time.perf_counter() - started)
    return batch["input_ids"].size / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    import numpy as np
    from titanax.runtime.cpu_devices import simulate_cpu_devices
    simulate_cpu_devices(8)
    from titanax.config import registry
    from titanax.data.packed import PackedDocuments
    from titanax.data.pretokenize import PackedRows, write_rows
    registry.load_config_modules(list(registry.DEFAULT_CONFIG_MODULES))
    cfg = registry.get_config("llama_tiny_packed")
    seq_len = cfg.train_input.source.seq_len
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = _corpus(tmp)
        started = time.perf_counter()
        packed = PackedDocuments.default_config().set(files=[jsonl], seq_len=seq_len,
                                                      held_out_fraction=0.0).instantiate()
        jsonl_build = time.perf_counter() - started
        write_rows(packed, os.path.join(tmp, "rows"), progress=False)
        started = time.perf_counter()
        rows = PackedRows.default_config().set(path=os.path.join(tmp, "rows")).instantiate()
        rows_build = time.perf_counter() - started
        input_cfg = cfg.train_input.clone(source=None)
        speeds = {"JSONL (PackedDocuments)": (jsonl_build, *_pipeline_speed(
                      input_cfg, packed, args.batches)),
                  "ArrayRecord (PackedRows)": (rows_build, *_pipeline_speed(
                      input_cfg, rows, args.batches))}
        engine = cfg.clone(train_input=None, evalers={}, checkpoint=None,
                           loggers=[]).instantiate()
        engine.init_state()
        batch = {k: np.stack([packed[i][k] for i in range(cfg.train_input.global_batch_size)])
                 for k in packed[0]}
        step_tokens = _step_speed(engine, batch, args.steps)
    print(f"train step (llama_tiny_packed, 8 CPU devices): {step_tokens:,.0f} tokens/s")
    print("source | build s | rows/s | tokens/s | input / step")
    for name, (build, rows_s, tokens_s) in speeds.items():
        print(f"{name} | {build:.1f} | {rows_s:,.0f} | {tokens_s:,.0f} | "
              f"{tokens_s / step_tokens:.1f}x")


if __name__ == "__main__":
    main()
