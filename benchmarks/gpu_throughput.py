"""Tokens/s and MFU of the Engine's train step (GPT-2, Llama 3) on one accelerator (GPU).

    python benchmarks/gpu_throughput.py --model gpt2_124m          # target >= 350k tok/s on H100
    python benchmarks/gpu_throughput.py --model gpt_1b             # target >= 45% MFU
    python benchmarks/gpu_throughput.py --model llama3_1b          # Llama 3.2 1B shapes
    python benchmarks/gpu_throughput.py --model tiny --cpu         # a smoke run on the CPU
    python benchmarks/gpu_throughput.py --model llama_tiny --cpu
    python benchmarks/gpu_throughput.py --model gpt2_124m --fp8          # FP8 projections
    python benchmarks/gpu_throughput.py --model gpt2_124m --optimizer muon

GPT-2 124M is ``gpt_small_dp_tp``'s model (12 layers, 768 wide, 12 heads, vocabulary padded to
50304) at sequence length 1024, computing in bfloat16 with float32 master params and AdamW, on
one device (mesh data=1). MFU is reported two ways, side by side:

* **compiled**: the FLOPs XLA's cost analysis counts for the compiled step (what really runs,
  including the optimizer and any rematerialisation) / step time / the device's dense bf16 peak;
* **model**: the usual analytic count, ``6 N + 12 L W S`` FLOPs per token
  (``CausalLanguageModel.flops_per_token``: N the params each token multiplies by -- a tied
  embedding counted once as the head, an untied one not at all, GQA's narrower k/v and SwiGLU's
  three matrices as they are; W the attention width heads x head_dim; the full S x S scores, as
  PaLM's appendix counts) x tokens per second / peak.

XLA flags that matter on GPUs are set here before jax starts (``--xla_flags`` adds more); the
chosen ones are printed with the result so a table in docs/performance.md can cite them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

MODELS = {
    # name: (layers, width, heads, vocab, seq, batch per device, accumulate)
    "gpt2_124m": (12, 768, 12, 50304, 1024, 32, 1),
    "gpt_1b": (24, 2048, 16, 50304, 1024, 8, 1),
    "tiny": (4, 128, 4, 256, 64, 8, 1),
    # Llama 3.2 1B (decoder.llama_config) and a CPU-sized Llama: seq, batch per device, accumulate.
    "llama3_1b": ("3.2-1b", None, None, None, 2048, 4, 1),
    "llama_tiny": ("tiny", None, None, None, 64, 8, 1),
}

# Flags for one GPU: the latency-hiding scheduler overlaps work, and command buffers (CUDA
# graphs) cut launch overhead of many small kernels.
GPU_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true "
             "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUDNN,CUSTOM_CALL")


def _optimizer(name: str):
    """AdamW (lr 3e-4, b2 0.95, wd 0.1), or Muon (peak 0.02 on the matrices) with that AdamW
    on the rest."""
    from titanax.config import config_for_function
    from titanax.train import optimizers
    if name == "muon":
        return config_for_function(optimizers.muon).set(
            learning_rate=0.02, adam_learning_rate=3e-4, adam_b2=0.95, adam_weight_decay=0.1)
    return config_for_function(optimizers.adamw).set(learning_rate=3e-4, b2=0.95,
                                                     weight_decay=0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2_124m")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step")
    parser.add_argument("--accumulate", type=int, default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--remat", default=None, help="GPT layer_remat_policy (e.g. "
                        "dots_with_no_batch_dims_saveable); None keeps activations")
    parser.add_argument("--unroll", choices=("default", "true", "false"), default="default")
    parser.add_argument("--xla_flags", default="", help="extra XLA_FLAGS")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (smoke test)")
    parser.add_argument("--fp8", action="store_true",
                        help="the projections in float8 (precision.fp8; modules/float8.py)")
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                        help="muon: Newton-Schulz on the matrices, AdamW on the rest")
    args = parser.parse_args()
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:
        os.environ["XLA_FLAGS"] = " ".join(
            f for f in (os.environ.get("XLA_FLAGS", ""), GPU_FLAGS, args.xla_flags) if f)
    import jax
    import numpy as np
    from titanax.modules.models.decoder import gpt_config
    from titanax.observe import memory, throughput
    from titanax.parallel.plan import DP, Plan
    from titanax.runtime.mesh import MeshSpec
    from titanax.train.engine import Engine
    from titanax.train.learner import Learner
    from titanax.train.precision import Precision

    layers, width, heads, vocab, seq, batch, accumulate = MODELS[args.model]
    batch = args.batch or batch
    accumulate = args.accumulate or accumulate
    if isinstance(layers, str):  # A Llama: its published shapes (or a tiny one).
        from titanax.modules.models.decoder import Decoder, llama_config
        model = (llama_config(layers, max_seq_len=seq) if layers != "tiny" else
                 Decoder.default_config().set(name="llama", vocab_size=256, max_seq_len=seq,
                                              num_layers=4, model_dim=128, num_heads=4,
                                              num_kv_heads=2, hidden_dim=352))
        model.layer_remat_policy = args.remat
        layers, width, heads, vocab = (model.num_layers, model.model_dim, model.num_heads,
                                       model.vocab_size)
    else:
        model = gpt_config().set(name="gpt", vocab_size=vocab, max_seq_len=seq,
                                         num_layers=layers, model_dim=width, num_heads=heads,
                                         layer_remat_policy=args.remat)
    if args.unroll != "default":
        model.unroll_layers = args.unroll == "true"
    engine = Engine.default_config().set(
        mesh=MeshSpec.default_config().set(axes=("data",), shape=(1,), devices=[0]),
        plan=Plan.default_config().set(
            data_parallel=DP.default_config().set(accumulate_steps=accumulate)),
        model=model,
        learner=Learner.default_config().set(optimizer=_optimizer(args.optimizer),
                                             max_grad_norm=1.0),
        precision=Precision.default_config().set(bfloat16=True, enable_x32_params=True,
                                                 fp8=args.fp8),
        loggers=[]).instantiate()
    engine.init_state()
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(engine.state.params))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    placed = engine.global_batch({"input_ids": ids[:, :-1], "target_ids": ids[:, 1:]})
    started = time.perf_counter()
    step = engine.compile(example_batch=placed)
    compile_s = time.perf_counter() - started
    for _ in range(3):  # Warm up.
        engine.state, metrics = step(engine.state, placed)
    jax.block_until_ready(engine.state)
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        engine.state, metrics = step(engine.state, placed)
        jax.block_until_ready(engine.state)
        times.append(time.perf_counter() - started)
    step_s = statistics.median(times)
    tokens = batch * seq
    tokens_per_s = tokens / step_s
    device = jax.devices()[0]
    peak = throughput.peak_flops(device)
    compiled_flops = step.latest_flops
    model_flops = engine.model.flops_per_token(seq) * tokens
    print(f"device: {device.device_kind} ({device.platform}); XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
    print(f"model {args.model}: {num_params / 1e6:.1f}M params, {layers} layers, width {width}, "
          f"heads {heads}, vocab {vocab}, seq {seq}, batch {batch} x accumulate {accumulate}, "
          f"{'fp8 projections, ' if args.fp8 else ''}bf16 compute, f32 params, "
          f"{args.optimizer}, remat {args.remat}")
    print(f"compile {compile_s:.1f}s; step {1e3 * step_s:.1f} ms (median of {args.steps}); "
          f"{tokens_per_s:,.0f} tokens/s; loss {float(metrics['loss']):.3f}")
    peak_bytes = memory.watermark_bytes(step.latest_step_bytes)
    if peak_bytes:
        print(f"memory watermark {peak_bytes / 2 ** 30:.2f} GiB")
    if peak is None:
        print("MFU: unknown (no peak FLOP/s for this device)")
        return
    if compiled_flops:
        print(f"MFU (compiled cost analysis): {compiled_flops / step_s / peak:.1%} "
              f"({compiled_flops / 1e12:.2f} TFLOP per step)")
    print(f"MFU (6N + 12LWS per token):    {model_flops / step_s / peak:.1%} "
          f"({model_flops / 1e12:.2f} TFLOP per step); peak {peak / 1e12:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
