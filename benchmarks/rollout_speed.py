"""Rollouts: the static sampler (``Decoder.sample``) vs the decode engine (titanax/decoding),
side by side in one run on the same model, prompts and settings.

    python benchmarks/rollout_speed.py            # ~3 min on 2 CPU cores

1. GRPO-shaped: ``--prompts`` prompts of ``--prompt_length`` tokens, ``--samples`` samples each,
   at most ``--max_new_tokens`` new tokens, temperature 1, lengths spread by stop ids (a set of
   ``--stop_ids`` tokens; a random model's near-uniform draws hit it about every
   vocab/stop_ids tokens). Rollout tokens/s (tokens up to each sample's stop, compile
   excluded; median of ``--rounds`` paired rounds, the order alternating) and their ratio.
2. Prompt prefill FLOPs (XLA's cost analysis of the compiled programs): the sampler prefills
   every sample's row, the engine each prompt once.
3. Continuous batching: 16 greedy requests of which 15 end after 8 tokens and one after 256,
   against 16 that all run 256 -- the engine's time for the first over the second.

4. Against transformers: the same random Llama (written by transformers, imported into Titanax)
   and the same GRPO-shaped work -- transformers' ``generate`` (sampling, ``num_return_sequences``
   samples per prompt, the stop ids as its end tokens, a KV cache; torch on the same cores) vs
   the engine: tokens/s of each, compile excluded, median of paired rounds.
5. GRPO steps: ``llama_tiny_grpo`` through the launcher (8 CPU devices, DP4 x TP2), completions
   of up to ``--grpo_new_tokens`` tokens, once with the static sampler and once with the engine
   (``--config.objective.decoding.block_size=16``), ``--grpo_steps`` steps each: the median
   per step of ``time/rollout_s`` and ``time/train_s`` (metrics.csv; the first step logs no
   ``time/train_s``) after the first three (compiling), and their ratio. The runs start from
   the same params and seed, but draw differently (the engine keys each draw by request,
   sample and token), so their completions -- and later their params -- differ: the per-token
   rollout rates are printed beside the times.

On a GPU (``benchmarks/gpu_check.sh rollouts``): ``--shape qwen3_0_6b`` runs part 1 on Qwen3
0.6B's shapes (random weights, bfloat16), at ``qwen3_0_6b_grpo``'s rollout: 16 prompts of 256
tokens, 8 samples, up to 512 new tokens (``--parts grpo``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--prompt_length", type=int, default=256)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--stop_ids", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model_dim", type=int, default=128)
    parser.add_argument("--num_layers", type=int, default=4)
    parser.add_argument("--vocab_size", type=int, default=512)
    parser.add_argument("--shape", choices=("small", "qwen3_0_6b"), default="small",
                        help="the model: --model_dim/--num_layers/--vocab_size, or Qwen3 0.6B's")
    parser.add_argument("--parts", default="grpo,short_long,transformers,grpo_steps",
                        help="which parts to run, comma-separated")
    parser.add_argument("--grpo_steps", type=int, default=12)
    parser.add_argument("--grpo_new_tokens", type=int, default=24)
    args = parser.parse_args()
    for name in ("prompts", "prompt_length", "samples", "max_new_tokens", "stop_ids", "rounds",
                 "model_dim", "num_layers", "vocab_size", "grpo_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.grpo_steps < 4:  # (Medians after the first three steps: at least one is left.)
        parser.error(f"--grpo_steps must be >= 4, got {args.grpo_steps}")
    if args.stop_ids >= args.vocab_size and args.shape == "small":
        parser.error(f"--stop_ids {args.stop_ids} leaves no prompt ids below --vocab_size "
                     f"{args.vocab_size}")
    return args


def _model(args):
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from titanax.modules.models import decoder  # pylint: disable=import-outside-toplevel
    if args.shape == "qwen3_0_6b":
        model = decoder.qwen3_config("0.6b").instantiate(parent=None)
        args.vocab_size = model.config.vocab_size
        params = jax.jit(model.initialize_parameters_recursively)(jax.random.PRNGKey(0))
        return model, jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), params)
    model = decoder.Decoder.default_config().set(
        name="d", vocab_size=args.vocab_size, max_seq_len=4096, model_dim=args.model_dim,
        num_heads=4, num_kv_heads=2, hidden_dim=args.model_dim * 3,
        num_layers=args.num_layers).instantiate(parent=None)
    return model, jax.jit(model.initialize_parameters_recursively)(jax.random.PRNGKey(0))


class Static:
    """The sampler over every sample's row (prompts repeated), stopping when all rows did."""

    def __init__(self, model, params, prompts, args):
        import jax  # pylint: disable=import-outside-toplevel
        import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
        from titanax.modules.module import functional  # pylint: disable=import-outside-toplevel
        self.ids = jnp.repeat(jnp.asarray(prompts), args.samples, axis=0)
        self.stops = tuple(range(args.stop_ids))

        def sample(params, ids, key, new_tokens):
            return functional(model, None, params, (ids, key), is_training=False,
                              method=lambda m, ids, key: m.sample(
                                  ids, key, max_new_tokens=new_tokens, temperature=1.0,
                                  end_ids=self.stops))[0]["tokens"]

        self.params = params
        self.run = jax.jit(lambda p, ids, key: sample(p, ids, key, args.max_new_tokens))
        self.prefill = jax.jit(lambda p, ids, key: sample(p, ids, key, 1))

    def tokens(self, seed):
        import jax  # pylint: disable=import-outside-toplevel
        import numpy as np  # pylint: disable=import-outside-toplevel
        rows = np.asarray(self.run(self.params, self.ids, jax.random.PRNGKey(seed)))
        return sum(_until_stop(list(row), self.stops) for row in rows)


def _until_stop(tokens, stops):
    """How many of ``tokens`` a sample keeps: up to its first stop id, itself included."""
    for index, token in enumerate(tokens):
        if token in stops:
            return index + 1
    return len(tokens)


def _requests(prompts, args):
    from titanax.decoding.engine import Request  # pylint: disable=import-outside-toplevel
    return [Request(prompt_ids=tuple(int(t) for t in p), max_new_tokens=args.max_new_tokens,
                    samples=args.samples, temperature=1.0, stop_ids=tuple(range(args.stop_ids)))
            for p in prompts]


def _engine(model, params, *, slots, pool_tokens, seed=0):
    from titanax.decoding.engine import DecodeEngine  # pylint: disable=import-outside-toplevel
    return DecodeEngine(model=model, params=params, pool_tokens=pool_tokens, block_size=16,
                        slots=slots, chunk_steps=8, seed=seed)


def _timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def grpo_shaped(model, params, args):
    """Tokens/s of both, paired rounds; the prefill FLOPs of both."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(0)
    prompts = rng.integers(args.stop_ids, args.vocab_size, (args.prompts, args.prompt_length))
    static = Static(model, params, prompts, args)
    rows = args.prompts * args.samples
    engine = _engine(model, params, slots=rows,
                     pool_tokens=rows * (args.prompt_length + args.max_new_tokens + 32))
    requests = _requests(prompts, args)
    static.tokens(0), engine.generate(requests)  # Compiled outside the timing.

    def engine_tokens():
        # The warm-up's keys (call 0): the same completions, so every decode batch size the
        # timed call meets is compiled already (another call's lengths could need another).
        engine.calls = 0
        return sum(len(c.tokens) for group in engine.generate(requests) for c in group)

    ratios, rates = [], {"sampler": [], "engine": []}
    for round_ in range(args.rounds):
        runs = [("sampler", lambda: static.tokens(0)), ("engine", engine_tokens)]
        for name, fn in (runs if round_ % 2 == 0 else runs[::-1]):
            tokens, seconds = _timed(fn)
            rates[name].append(tokens / seconds)
        ratios.append(rates["engine"][-1] / rates["sampler"][-1])
    for name, values in rates.items():
        print(f"rollout tokens/s  {name:8s} {statistics.median(values):10.1f}")
    print(f"rollout tokens/s  engine / sampler: {statistics.median(ratios):.2f}x "
          f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})")
    _prefill_flops(static, engine, prompts, params)


def _prefill_flops(static, engine, prompts, params):
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    from titanax.decoding.paged_attention import Paging  # pylint: disable=import-outside-toplevel
    old = static.prefill.lower(params, static.ids, jax.random.PRNGKey(0)).compile()
    rows, length = prompts.shape
    width = engine.book.blocks_for(length)
    paging = Paging(tables=np.zeros((rows, width), np.int32),
                    positions=np.tile(np.arange(length, dtype=np.int32), (rows, 1)))
    new = engine._prefill.lower(  # pylint: disable=protected-access
        params, engine.pools, np.asarray(prompts, np.int32), paging).compile()
    old_flops, new_flops = (c.cost_analysis()["flops"] for c in (old, new))
    print(f"prompt prefill FLOPs  sampler {old_flops:.3e}  engine {new_flops:.3e}  "
          f"engine / sampler {new_flops / old_flops:.3f}")


def short_and_long(model, params, args):
    """16 greedy requests, 15 ending after 8 tokens and one after 256, against 16 of 256."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    from titanax.decoding.engine import Request  # pylint: disable=import-outside-toplevel
    prompts = np.random.default_rng(1).integers(0, args.vocab_size, (16, 32))

    def requests(budgets):
        return [Request(prompt_ids=tuple(int(t) for t in p), max_new_tokens=b)
                for p, b in zip(prompts, budgets)]

    mixed, uniform = requests([8] * 15 + [256]), requests([256] * 16)
    engine = _engine(model, params, slots=16, pool_tokens=16 * (32 + 256 + 16))
    engine.generate(mixed), engine.generate(uniform)  # Every chunk size compiled (greedy:
    # the same completions each call).
    ratios = []
    for _ in range(args.rounds):
        _, short = _timed(lambda: engine.generate(mixed))
        _, full = _timed(lambda: engine.generate(uniform))
        ratios.append(short / full)
    print(f"15 short + 1 long / 16 long (engine): {statistics.median(ratios):.2f} "
          f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})")


def versus_transformers(args):
    """Tokens/s of transformers' ``generate`` and of the engine on one random Llama."""
    import tempfile  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
    from titanax.hf import importer  # pylint: disable=import-outside-toplevel
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.model_dim,
        intermediate_size=3 * args.model_dim, num_hidden_layers=args.num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=list(range(args.stop_ids)), pad_token_id=0,
        tie_word_embeddings=False)).eval()
    with tempfile.TemporaryDirectory() as directory:
        hf.save_pretrained(directory)
        model = importer.model_config(directory).instantiate(parent=None)
        params = importer.params_as_numpy(directory)
    rng = np.random.default_rng(0)
    prompts = rng.integers(args.stop_ids, args.vocab_size, (args.prompts, args.prompt_length))
    _check_same_model(hf, model, params, prompts)
    rows = args.prompts * args.samples
    engine = _engine(model, params, slots=rows,
                     pool_tokens=rows * (args.prompt_length + args.max_new_tokens + 32))
    requests = _requests(prompts, args)
    engine.generate(requests)

    def engine_tokens():
        engine.calls = 0
        return sum(len(c.tokens) for group in engine.generate(requests) for c in group)

    def hf_tokens():
        with torch.no_grad():
            ids = torch.tensor(prompts)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                              temperature=1.0, top_k=0,
                              num_return_sequences=args.samples,
                              max_new_tokens=args.max_new_tokens, min_new_tokens=1)
        stops = set(range(args.stop_ids))
        return sum(_until_stop(row.tolist(), stops) for row in out[:, args.prompt_length:])

    hf_tokens()  # (Warm-up.)
    ratios, rates = [], {"transformers": [], "engine": []}
    for round_ in range(args.rounds):
        runs = [("transformers", hf_tokens), ("engine", engine_tokens)]
        for name, fn in (runs if round_ % 2 == 0 else runs[::-1]):
            tokens, seconds = _timed(fn)
            rates[name].append(tokens / seconds)
        ratios.append(rates["engine"][-1] / rates["transformers"][-1])
    for name, values in rates.items():
        print(f"tokens/s  {name:12s} {statistics.median(values):10.1f}")
    print(f"tokens/s  engine / transformers generate: {statistics.median(ratios):.2f}x "
          f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})")


def _check_same_model(hf, model, params, prompts):
    """Both sides run one model: the logits of the prompts agree (float32)."""
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import torch  # pylint: disable=import-outside-toplevel
    from titanax.modules.module import functional  # pylint: disable=import-outside-toplevel
    with torch.no_grad():
        want = hf(torch.tensor(prompts)).logits.numpy()
    got = np.asarray(functional(model, None, params, (jnp.asarray(prompts, jnp.int32),),
                                method="logits", is_training=False)[0])
    difference = float(np.abs(got - want).max())
    assert difference <= 1e-3 * max(1.0, float(np.abs(want).max())), difference
    print(f"transformers vs Titanax logits on the prompts: max |difference| {difference:.1e}")


def grpo_steps(args):
    """Part 5: time per GRPO step, the static sampler's run against the engine's."""
    import csv  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel
    import tempfile  # pylint: disable=import-outside-toplevel
    common = ["--config=llama_tiny_grpo", "--cpu_devices=8", "--config.log_every=1",
              f"--config.max_steps={args.grpo_steps}",
              f"--config.objective.max_new_tokens={args.grpo_new_tokens}",
              # (Room for the longer completions: prompts of up to 5 tokens.)
              f"--config.model.max_seq_len={8 + args.grpo_new_tokens}",
              "--config.checkpoint.save_every_n_steps=100000"]
    medians = {}
    with tempfile.TemporaryDirectory() as root:
        for name, extra in (("sampler", []),
                            ("engine", ["--config.objective.decoding.block_size=16"])):
            folder = os.path.join(root, name)
            subprocess.run([sys.executable, "-m", "titanax.launch", *common, *extra,
                            f"--trainer_dir={folder}"], cwd=REPO_ROOT, check=True,
                           stdout=subprocess.DEVNULL)
            with open(os.path.join(folder, "metrics.csv"), encoding="utf-8") as f:
                rows = [r for r in csv.DictReader(f) if r.get("time/train_s")][2:]
            medians[name] = {key: statistics.median(float(r[key]) for r in rows) for key in (
                "time/rollout_s", "time/train_s", "rollout/tokens_per_s")}
    for name, values in medians.items():
        step = values["time/rollout_s"] + values["time/train_s"]
        print(f"grpo step s       {name:8s} {step:8.3f} (rollout {values['time/rollout_s']:.3f}, "
              f"train {values['time/train_s']:.3f}; rollout tokens/s "
              f"{values['rollout/tokens_per_s']:.0f})")
    total = {n: v["time/rollout_s"] + v["time/train_s"] for n, v in medians.items()}
    rollout = {n: v["time/rollout_s"] for n, v in medians.items()}
    print(f"grpo step s       engine / sampler: {total['engine'] / total['sampler']:.2f} "
          f"(rollout alone: {rollout['engine'] / rollout['sampler']:.2f})")


def main():
    args = _parse()
    parts = set(args.parts.split(","))
    unknown = parts - {"grpo", "short_long", "transformers", "grpo_steps"}
    if unknown:
        raise SystemExit(f"--parts: unknown {sorted(unknown)}")
    if parts & {"grpo", "short_long"}:
        model, params = _model(args)
        if "grpo" in parts:
            grpo_shaped(model, params, args)
        if "short_long" in parts:
            short_and_long(model, params, args)
    if "transformers" in parts:
        versus_transformers(args)
    if "grpo_steps" in parts:
        grpo_steps(args)


if __name__ == "__main__":
    main()
