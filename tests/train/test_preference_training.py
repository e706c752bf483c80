"""Preference tuning through the engine (``--config.objective`` a Preference): every loss at the start, where
the policy is its reference (DPO's is log 2, hinge's 1, IPO's 1 / (2 beta)^2, the rewards 0);
the reference -- a frozen copy of the starting weights, or with LoRA the base -- never moves;
TRL's metric names in metrics.csv; and ``llama_tiny_dpo`` learning a synthetic preference with
and without LoRA."""

import csv
import json
import math
import random

import jax
import numpy as np
import pytest

from tests.commands import run_module
from tests.numerics import assert_close, assert_identical
from tests.train import helpers
from titanax import errors
from titanax.data.pipeline import Input
from titanax.data.preference import PreferencePairs
from titanax.modules.lora import LoRA
from titanax.modules.models.decoder import Decoder
from titanax.objectives.preference import Preference
from titanax.parallel.context_parallel import CP
from titanax.parallel.plan import DP, TP, Plan, ZeRO
from titanax.train.engine import Engine

MODEL = dict(name="llama", vocab_size=256, max_seq_len=32, num_layers=2, model_dim=32,
             num_heads=4, num_kv_heads=2, hidden_dim=48)
WORDS = ["apple", "river", "stone", "cloud", "ember", "maple", "tiger", "lemon", "quill", "ocean"]


def synthetic_pairs(path, count=600, seed=0):
    """Prompts "<a> <b> ->": the chosen answer swaps the words, the rejected one echoes them."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            a, b = rng.sample(WORDS, 2)
            f.write(json.dumps({"prompt": f"{a} {b} ->", "chosen": f" {b} {a}.",
                                "rejected": f" {a} {b}."}) + "\n")
    return str(path)


def _engine(files, *, loss="sigmoid", lora=False, model=1, reference_from=None, **changes):
    plan = Plan.default_config().set(data_parallel=DP.default_config(),
                                     tensor_parallel=TP.default_config() if model > 1 else None)
    axes = ("data", "model") if model > 1 else ("data",)
    cfg = Engine.default_config().set(
        mesh=helpers.mesh((8 // model, model) if model > 1 else (8,), axes),
        plan=plan, model=Decoder.default_config().set(**MODEL),
        train_input=Input.default_config().set(
            source=PreferencePairs.default_config().set(files=[files], seq_len=32),
            global_batch_size=16),
        objective=Preference.default_config().set(loss=loss, reference_from=reference_from),
        lora=LoRA.default_config().set(rank=4) if lora else None,
        learner=helpers.adam(1e-3), loggers=[], log_every=1, max_steps=3)
    return cfg.set(**changes).instantiate()


# loss -> its value where the policy is its reference (beta 0.1), None: depends on the model.
AT_THE_START = {"sigmoid": math.log(2.0), "hinge": 1.0, "ipo": (1 / (2 * 0.1)) ** 2,
                "simpo": None, "orpo": None}


@pytest.mark.parametrize("loss", sorted(AT_THE_START))
def test_each_loss_starts_where_the_policy_is_its_reference_and_trains(tmp_path, loss):
    engine = _engine(synthetic_pairs(tmp_path / "p.jsonl"), loss=loss)
    engine.fit(steps=3)
    first, last = engine.history[0], engine.history[-1]
    if AT_THE_START[loss] is not None:
        assert abs(first["loss"] - AT_THE_START[loss]) < 1e-5 * AT_THE_START[loss], first
        # Zero but for float32 rounding: the policy's log-probs come from the differentiated
        # step, the reference's from a forward alone (beta 0.1 times their difference).
        logps = max(abs(first["logps/chosen"]), abs(first["logps/rejected"]))
        for side in ("rewards/chosen", "rewards/rejected"):
            assert abs(first[side]) <= 0.1 * 1e-6 * logps, (side, first)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                 "logps/chosen", "logps/rejected"):
        assert np.isfinite(last[name]), (name, last)
    assert last["logps/chosen"] < 0 and np.isfinite(last["loss"]), last


@pytest.mark.parametrize("lora", [False, True], ids=["frozen-copy", "lora-base"])
def test_the_reference_never_moves(tmp_path, lora):
    engine = _engine(synthetic_pairs(tmp_path / "p.jsonl"), lora=lora, model=2)
    engine.init_or_restore()
    params = jax.device_get(engine.canonical_params())
    assert ("reference" in params) == (not lora)
    start = helpers.flat(params)
    engine.fit(steps=3)
    end = helpers.flat(jax.device_get(engine.canonical_params()))
    frozen = [k for k in start if k.startswith("reference/") or (lora and "_lora_" not in k)]
    assert frozen
    assert_identical({k: end[k] for k in frozen}, {k: start[k] for k in frozen},
                     what="the reference")
    if not lora:  # The copy is the starting policy; the policy moved.
        policy = [k for k in start if not k.startswith("reference/")]
        for k in policy:
            np.testing.assert_array_equal(start[f"reference/{k}"], start[k])
        assert any(not np.array_equal(end[k], start[k]) for k in policy)
    # The optimizer holds state for the trained params only.
    sizes = sorted(x.size for x in jax.tree_util.tree_leaves(engine.state.opt_state)
                   if x.size > 1)
    trained = sorted(v.size for k, v in end.items()
                     if (("_lora_" in k) if lora else not k.startswith("reference/")))
    assert sizes == sorted(trained * 2)  # Adam: two moments each.


def test_misplaced_reference_options_are_refused(tmp_path):
    files = synthetic_pairs(tmp_path / "p.jsonl", count=40)
    with pytest.raises(errors.ConfigError, match="reference-free"):
        _engine(files, loss="simpo", reference_from=str(tmp_path)).build()
    with pytest.raises(errors.UnknownFieldError, match="reference_from"):  # (ModelLoss: none.)
        Engine.default_config().objective.reference_from = str(tmp_path)
    with pytest.raises(errors.ConfigError, match="no config.json"):
        _engine(files, reference_from=str(tmp_path / "missing")).build()
    with pytest.raises(errors.PlanError, match="context parallelism"):
        _engine(files, mesh=helpers.mesh((2, 4), ("data", "context")),
                plan=Plan.default_config().set(
                    data_parallel=DP.default_config(),
                    context_parallel=CP.default_config().set(axis="context"))).build()


def test_llama_tiny_dpo_learns_a_synthetic_preference(tmp_path):
    """The registered experiment as a user launches it (its 4-layer model, AdamW, 200 steps of
    16 pairs, the held-out evaluation), on the swap-vs-echo set, every weight trained (LoRA's
    DPO learning: docs/preference_tuning.md's recipe, walked by tests/test_preference_doc.py).
    On one device, in a child with XLA's optimised CPU code: 200 steps cost 47 s of CPU there
    against 122 s on this process's 8 devices and quick backend in float64. float32 is safe
    here: the run ends far past the bars (measured: every held-out pair of 60 and every pair of
    the last 10 batches ranked right, margins ~6.5), not 1/16 of a batch away from them."""
    files = synthetic_pairs(tmp_path / "pairs.jsonl")
    heldout = "--config.evalers['heldout']"
    run_module("titanax.launch", "--config=llama_tiny_dpo", "--cpu_devices=1",
               "--config.mesh.shape=(1,1)", f"--trainer_dir={tmp_path / 'run'}",
               f"--config.train_input.source.files=['{files}']",
               f"{heldout}.input.source.files=['{files}']",
               # (The pairs are under 30 bytes: half the experiment's rows.)
               "--config.train_input.source.seq_len=32", f"{heldout}.input.source.seq_len=32",
               f"{heldout}.every_n_steps=1000",  # (Evaluated once, at the end.)
               "--config.log_every=1", "--config.checkpoint=None", quick_backend=False)
    with open(tmp_path / "run" / "metrics.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    train = [float(r["rewards/accuracies"]) for r in rows if r["rewards/accuracies"]]
    held_out = [float(r["heldout/accuracy"]) for r in rows if r["heldout/accuracy"]]
    assert len(train) == 200 and len(held_out) == 1, (len(train), held_out)
    assert held_out[0] >= 0.9, held_out
    assert np.mean(train[-10:]) >= 0.9, train  # The last 160 pairs trained on.


def test_dpo_under_fsdp_and_tp_trains_like_data_parallel(tmp_path):
    """The same losses and params after 3 SGD steps on data=8 and on FSDP(4) x TP(2) -- the
    policy's and the frozen reference's passes gathered and split alike."""
    files = synthetic_pairs(tmp_path / "p.jsonl")
    runs = []
    for model, zero in ((1, None), (2, ZeRO.default_config().set(stage=3, min_shard_size=16))):
        engine = _engine(files, model=model, learner=helpers.sgd(0.5))
        if zero is not None:
            engine = engine.config.clone(plan=engine.config.plan.clone(zero=zero)).instantiate()
        engine.fit(steps=3)
        runs.append(([h["loss"] for h in engine.history],
                     jax.tree_util.tree_map(np.asarray,
                                            jax.device_get(engine.canonical_params()))))
    (losses, params), (other_losses, other_params) = runs
    assert_close(other_losses, losses, what="losses")
    assert_close(other_params, params, what="params after 3 SGD steps")


def test_orpo_stays_finite_where_the_policy_is_sure():
    """A completion whose mean log-prob rounds to 0 in log(1 - exp(.)): finite loss and
    gradient (both branches of the odds' where are differentiated)."""
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    orpo = Preference.default_config().set(loss="orpo").instantiate()

    def loss(pc):
        return orpo.pair_losses(policy={"chosen": pc, "rejected": jnp.asarray([-5.0])},
                                reference=None, tokens={"chosen": jnp.asarray([3.0]),
                                                        "rejected": jnp.asarray([3.0])}).loss[0]

    for value in (-3e-8, -1e-3, -2.0):
        grad = jax.grad(loss)(jnp.asarray([value]))
        assert np.all(np.isfinite(grad)) and np.isfinite(loss(jnp.asarray([value]))), value


def test_a_preference_loss_and_its_data_must_agree(tmp_path):
    files = synthetic_pairs(tmp_path / "p.jsonl", count=40)
    with pytest.raises(errors.ConfigError, match="reads preference pairs, and the ModelLoss"):
        _engine(files, objective=Engine.default_config().objective).build()
    text = Input.default_config().set(global_batch_size=16)
    from titanax.data.sources import TextWindows  # pylint: disable=import-outside-toplevel
    text.source = TextWindows.default_config().set(seq_len=32)
    with pytest.raises(errors.ConfigError, match="trains on preference pairs"):
        _engine(files, train_input=text).build()


def test_dpo_with_accumulation_trains_like_the_whole_batch(tmp_path):
    """Microbatches of a pair batch (each shard's pairs in 2 parts) give the whole batch's
    losses and params: the pairs' weights add up across the parts."""
    files = synthetic_pairs(tmp_path / "p.jsonl")
    runs = []
    for accumulate in (1, 2):
        engine = _engine(files, learner=helpers.sgd(0.5), plan=Plan.default_config().set(
            data_parallel=DP.default_config().set(accumulate_steps=accumulate)))
        engine.fit(steps=3)
        runs.append(([h["loss"] for h in engine.history],
                     jax.device_get(engine.canonical_params())))
    assert_close(runs[1][0], runs[0][0], what="losses")
    assert_close(runs[1][1], runs[0][1], what="params after 3 SGD steps")


def test_a_dpo_run_resumes_bit_identically_with_its_reference(tmp_path):
    files = synthetic_pairs(tmp_path / "p.jsonl")
    straight, second = helpers.straight_and_resumed(
        lambda checkpoint: _engine(files, checkpoint=checkpoint), root=tmp_path)
    assert_identical(jax.device_get(second.state.params), jax.device_get(straight.state.params))
