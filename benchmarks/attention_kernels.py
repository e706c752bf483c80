"""Dense vs fused vs Pallas vs blockwise causal attention at one long sequence: time, memory,
parity.

    python benchmarks/attention_kernels.py                      # on the GPU: S = 8192, bf16
    python benchmarks/attention_kernels.py --documents 4        # rows packing 4 documents
    python benchmarks/attention_kernels.py --cpu --seq 2048     # a smoke run on the CPU

For each implementation of ``modules/layers/attention.attend`` (``dense``: scores written out;
``fused``: ``jax.nn.dot_product_attention`` as jax picks; ``cudnn``: the same asked for cuDNN's
kernel by name; ``pallas``: jax's Pallas flash kernel; ``blockwise``: the O(S) online-softmax
kernel; ``auto``: what the model uses) it compiles ``value_and_grad`` of a weighted sum of the
outputs over
q, k, v (Llama 3 8B's heads: 32 query heads, 8 kv heads, head_dim 128) and prints the median
time of a forward + backward, the compiled temp memory, and the largest difference of the output
and of each gradient from dense attention in float32 (scaled by dense's largest magnitude).
An implementation that does not compile or run here (fused on a CPU in float16, dense out of
memory) is reported as such, not skipped silently.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv_heads", type=int, default=8)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--documents", type=int, default=1,
                        help="documents packed in each row (segment ids; cuDNN by name gets "
                             "them as a dense mask)")
    parser.add_argument("--block", type=int, default=512, help="blockwise block length")
    parser.add_argument("--implementations", default="dense,fused,cudnn,pallas,blockwise,auto",
                        help="which to run, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (smoke test)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    from titanax.modules.layers.attention import attend, same_segment  # pylint: disable=import-outside-toplevel

    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    shapes = ((args.batch, args.seq, args.heads, args.head_dim),
              (args.batch, args.seq, args.kv_heads, args.head_dim))
    host = [rng.normal(size=shapes[0]), rng.normal(size=shapes[1]), rng.normal(size=shapes[1])]
    weights = rng.normal(size=shapes[0])
    # Documents of uneven lengths (segment ids 1..N), the same in every row.
    cuts = np.sort(rng.choice(np.arange(1, args.seq), size=args.documents - 1, replace=False))
    segment_ids = (np.broadcast_to(np.searchsorted(cuts, np.arange(args.seq), side="right") + 1,
                                   (args.batch, args.seq)) if args.documents > 1 else None)

    def loss_fn(implementation, dt):
        w = jnp.asarray(weights, dt)

        segments = None if segment_ids is None else jnp.asarray(segment_ids)

        def loss(q, k, v):
            if implementation == "cudnn":  # jax's cuDNN kernel asked for by name.
                out = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                   scale=args.head_dim ** -0.5,
                                                   mask=same_segment(segments),
                                                   implementation="cudnn")
            else:
                out = attend(q, k, v, implementation=implementation, block_size=args.block,
                             segment_ids=segments)
            return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32)), out
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    def run(implementation, dt):
        q, k, v = (jnp.asarray(x, dt) for x in host)
        fn = loss_fn(implementation, dt)
        compiled = fn.lower(q, k, v).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        (_, out), grads = jax.block_until_ready(compiled(q, k, v))
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v))
            times.append(time.perf_counter() - started)
        return statistics.median(times), temp, out, grads

    def scaled_error(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))

    print(f"device {jax.devices()[0].device_kind}; S={args.seq} batch={args.batch} "
          f"heads={args.heads}/{args.kv_heads} head_dim={args.head_dim} {dtype.name} "
          f"documents={args.documents}", flush=True)
    results = {}
    reference = None
    try:
        reference = run("dense", jnp.float32)[2:]
    except Exception as e:  # pylint: disable=broad-except  (reported, not hidden)
        print(f"float32 dense reference failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    for implementation in args.implementations.split(","):
        try:
            seconds, temp, out, grads = run(implementation, dtype)
        except Exception as e:  # pylint: disable=broad-except  (reported, not hidden)
            results[implementation] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{implementation:>9}: failed: {results[implementation]['error']}", flush=True)
            continue
        row = {"ms": 1e3 * seconds, "temp_mib": temp / 2**20}
        if reference is not None:
            row["output_error"] = scaled_error(out, reference[0])
            row["grad_errors"] = [scaled_error(g, r) for g, r in zip(grads, reference[1])]
        results[implementation] = row
        print(f"{implementation:>9}: {row['ms']:9.2f} ms fwd+bwd  temp {row['temp_mib']:9.1f} MiB"
              + (f"  vs dense f32: out {row['output_error']:.2e}, dq/dk/dv "
                 + ", ".join(f"{e:.2e}" for e in row["grad_errors"]) if reference else ""),
              flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
