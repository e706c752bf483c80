"""A GRPO engine on the bundled sums' tokenizer (16 ids), for the rl tests."""

import json
import random

from tests.train import helpers
from titanax.data.pipeline import Input
from titanax.data.prompts import Prompts
from titanax.modules.models.decoder import Decoder
from titanax.parallel.plan import DP, TP, Plan, ZeRO
from titanax.objectives.grpo import GRPO
from titanax.train.objective import ModelLoss
from titanax.rl.rewards import AnswerMatch
from titanax.train.engine import Engine

SUMS = "bundled:sums"
MODEL = dict(name="llama", vocab_size=16, max_seq_len=24, num_layers=2, model_dim=32,
             num_heads=4, num_kv_heads=2, hidden_dim=48)
# Mesh shape and axes, plan pieces, per layout.
LAYOUTS = {
    "dp": ((8,), ("data",), {}),
    "dp_tp": ((4, 2), ("data", "model"), {"tensor_parallel": TP.default_config()}),
    "fsdp": ((8,), ("data",), {"zero": ZeRO.default_config().set(stage=3)}),
}


def sums_file(path, count=64, seed=0):
    """Sums of numbers of 1 to 3 digits ("12+345="): prompts of 4 to 8 tokens."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            a, b = rng.randrange(10 ** rng.randint(1, 3)), rng.randrange(10 ** rng.randint(1, 3))
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return str(path)


DEFAULT = object()


def engine(files, *, layout="dp", prompts=8, grpo=DEFAULT, **changes) -> Engine:
    shape, axes, plan = LAYOUTS[layout]
    source = Prompts.default_config().set(files=[files], max_prompt_tokens=8)
    prompt_input = Input.default_config().set(source=source, global_batch_size=prompts)
    prompt_input.tokenizer.path = SUMS
    cfg = Engine.default_config().set(
        mesh=helpers.mesh(shape, axes),
        plan=Plan.default_config().set(data_parallel=DP.default_config(), **plan),
        model=Decoder.default_config().set(**MODEL), train_input=prompt_input,
        objective=GRPO.default_config().set(
            num_generations=4, max_new_tokens=8, temperature=0.8,
            rewards={"answer": AnswerMatch.default_config()}) if grpo is DEFAULT else (
                grpo if grpo is not None else ModelLoss.default_config()),
        learner=helpers.adam(1e-3), loggers=[], log_every=1, max_steps=2)
    return cfg.set(**changes).instantiate()


def recomputed_logps(run, params, rows):
    """The train step's log-probs (temperature 0.8, the helpers' GRPO's) of rollout ``rows``
    under ``params``, on ``run``'s mesh: what a sampler's ``old_logps`` are checked against."""
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    recompute = run.steps.model_method("token_logps", constants=(0.8,))
    placed = run.inputs.placed({k: rows[k] for k in ("input_ids", "target_ids",
                                                     "segment_ids", "positions")})
    return np.asarray(jax.device_get(recompute(
        params, placed["input_ids"], placed["target_ids"], placed["segment_ids"],
        placed["positions"])))
