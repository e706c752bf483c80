"""A SwiGLU MLP block's forward and backward in bfloat16 vs FP8 projections, side by side.

    python benchmarks/fp8_mlp.py                      # 4096 x 14336 (Llama 3 8B's), 8192 tokens
    python benchmarks/fp8_mlp.py --cpu --small        # a smoke run on the CPU

The block is ``down(silu(x W_gate) * (x W_up))`` with ``W_gate, W_up [D, F]`` fused as
``[D, 2, F]`` and ``W_down [F, D]``, its products written as Titanax's layers write them
(``float8.einsum``): plain bfloat16 dots, or inside an FP8 scope (modules/float8.py: e4m3
operands forward, the gradient in e5m2). Timed: the jitted gradient with respect to the input
and both weights, in interleaved rounds; the figure is the median of the per-round ratios
bfloat16 / FP8 (above 1: FP8 is faster). Also printed: the relative difference of FP8's output
and gradients from bfloat16's, so a fast wrong answer shows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=_positive, default=None, help="model width (4096)")
    parser.add_argument("--hidden", type=_positive, default=None, help="MLP width (14336)")
    parser.add_argument("--tokens", type=_positive, default=None, help="tokens per step (8192)")
    parser.add_argument("--rounds", type=_positive, default=10)
    parser.add_argument("--rowwise", action="store_true", help="row-wise FP8 scales")
    parser.add_argument("--small", action="store_true",
                        help="256 x 512, 256 tokens (not with --dim/--hidden/--tokens)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (smoke test)")
    args = parser.parse_args()
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    sizes = (args.dim, args.hidden, args.tokens)
    if args.small and any(size is not None for size in sizes):
        parser.error("--small sets --dim, --hidden and --tokens: give either, not both")
    defaults = (256, 512, 256) if args.small else (4096, 14336, 8192)
    args.dim, args.hidden, args.tokens = (size if size is not None else default
                                          for size, default in zip(sizes, defaults))
    import jax
    import jax.numpy as jnp
    from titanax.modules import float8

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], (args.tokens, args.dim), jnp.bfloat16)
    gate_up = (jax.random.normal(keys[1], (args.dim, 2, args.hidden)) *
               args.dim ** -0.5).astype(jnp.bfloat16)
    down = (jax.random.normal(keys[2], (args.hidden, args.dim)) *
            args.hidden ** -0.5).astype(jnp.bfloat16)

    def block(x, gate_up, down):
        both = float8.einsum("td,dsf->tsf", x, gate_up)
        hidden = jax.nn.silu(both[:, 0]) * both[:, 1]
        return float8.einsum("tf,fd->td", hidden, down)

    def loss(x, gate_up, down, fp8: bool):
        settings = float8.Float8Settings(rowwise=args.rowwise) if fp8 else None
        with float8.scope(settings):
            y = block(x, gate_up, down)
        return jnp.sum(y.astype(jnp.float32) ** 2) / y.size, y

    steps = {name: jax.jit(jax.value_and_grad(
        lambda a, b, c, fp8=fp8: loss(a, b, c, fp8), argnums=(0, 1, 2), has_aux=True))
        for name, fp8 in (("bf16", False), ("fp8", True))}
    outputs = {}
    for name, step in steps.items():
        outputs[name] = jax.block_until_ready(step(x, gate_up, down))  # Compile and warm up.
    times = {name: [] for name in steps}
    for round_index in range(args.rounds):
        for name in (("bf16", "fp8") if round_index % 2 else ("fp8", "bf16")):
            started = time.perf_counter()
            jax.block_until_ready(steps[name](x, gate_up, down))
            times[name].append(time.perf_counter() - started)
    (_, y_bf16), grads_bf16 = outputs["bf16"]
    (_, y_fp8), grads_fp8 = outputs["fp8"]

    def relative(a, b):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

    flops = 2 * 3 * args.tokens * args.dim * args.hidden * 3  # 3 matmuls, forward + 2 backward
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}); MLP {args.dim} x {args.hidden}, "
          f"{args.tokens} tokens, {'row-wise' if args.rowwise else 'per-tensor'} scales")
    for name in steps:
        median = statistics.median(times[name])
        print(f"{name}: {1e3 * median:.2f} ms forward + backward, "
              f"{flops / median / 1e12:.1f} TFLOP/s")
    ratio = statistics.median([b / f for b, f in zip(times["bf16"], times["fp8"])])
    print(f"bf16 / fp8 time: {ratio:.2f}x (median of {args.rounds} paired rounds)")
    print("fp8 vs bf16, relative: output {:.3g}, dx {:.3g}, dW_gate_up {:.3g}, dW_down {:.3g}"
          .format(relative(y_fp8, y_bf16), *(relative(f, b) for f, b in
                                               zip(grads_fp8, grads_bf16))))


if __name__ == "__main__":
    main()
