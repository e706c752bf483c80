"""KTO through the engine (``--config.objective`` a KTO): at the start, where the policy is its
reference, the loss is the labels' weights over 2 and the KL 0; the batch's KL estimate is one
number on every mesh (1 device = data 8 = data 4 x model 2); bad data and settings are refused
by name. (Its numbers against TRL's ``KTOTrainer``: tests/hf/test_kto_parity.py; that
``llama_tiny_kto`` learns -- every weight trained, the held-out records all on the right side:
docs/preference_tuning.md, walked by tests/test_preference_doc.py.)"""

import json
import random

import jax
import numpy as np
import pytest

from tests.numerics import assert_close
from tests.train import helpers
from titanax import errors
from titanax.data.pipeline import Input
from titanax.data.preference import PreferencePairs
from titanax.data.unpaired import UnpairedPreferences
from titanax.modules.models.decoder import Decoder
from titanax.objectives.kto import KTO
from titanax.objectives.preference import Preference
from titanax.parallel.context_parallel import CP
from titanax.parallel.plan import DP, TP, Plan
from titanax.train.engine import Engine

MODEL = dict(name="llama", vocab_size=256, max_seq_len=32, num_layers=2, model_dim=32,
             num_heads=4, num_kv_heads=2, hidden_dim=48)
WORDS = ["apple", "river", "stone", "cloud", "ember", "maple", "tiger", "lemon", "quill", "ocean"]
DESIRABLE = WORDS[:5]


def labelled_completions(path, count=600, seed=0):
    """Prompts "<a> <b> ->" completed by one word: desirable when it is one of the first five
    words, undesirable otherwise -- a label the completion alone decides."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            a, b = rng.sample(WORDS, 2)
            word = rng.choice(WORDS)
            f.write(json.dumps({"prompt": f"{a} {b} ->", "completion": f" {word}.",
                                "label": word in DESIRABLE}) + "\n")
    return str(path)


def _engine(files, *, shape=(8,), axes=("data",), objective=None, devices=None, **changes):
    plan = Plan.default_config().set(data_parallel=DP.default_config(),
                                     tensor_parallel=TP.default_config()
                                     if "model" in axes else None)
    cfg = Engine.default_config().set(
        mesh=helpers.mesh(shape, axes, devices=devices), plan=plan, model=Decoder.default_config().set(**MODEL),
        train_input=Input.default_config().set(
            source=UnpairedPreferences.default_config().set(files=[files], seq_len=32,
                                                             seed=None),
            global_batch_size=16),
        objective=objective or KTO.default_config(),
        learner=helpers.adam(1e-3), loggers=[], log_every=1, max_steps=3)
    return cfg.set(**changes).instantiate()


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.3, 0.7)], ids=["equal", "weighted"])
def test_at_the_start_the_loss_is_half_the_weights(tmp_path, weights):
    """Policy = reference: every implied reward and the KL are 0, so each example's loss is
    its label's weight x (1 - sigmoid(0))."""
    files = labelled_completions(tmp_path / "k.jsonl", count=40)
    engine = _engine(files, objective=KTO.default_config().set(
        desirable_weight=weights[0], undesirable_weight=weights[1]))
    labels = engine.first_train_batch()["label"]
    engine.fit(steps=1)
    first = engine.history[0]
    want = float(np.mean(np.where(labels > 0, weights[0], weights[1]))) / 2
    assert_close(first["loss"], want, bound=1e-6, what="the loss at the start")
    for name in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(first[name]) <= 1e-6, (name, first[name])
    assert first["logps/chosen"] < 0 and first["logps/rejected"] < 0
    # --explain says what the run trains toward, and which reference it holds.
    assert (f"objective: KTO (beta 0.1, desirable x{weights[0]}, undesirable x{weights[1]}); "
            "reference: the starting weights (a frozen copy under params/reference)"
            in engine.explain())


def test_the_kl_estimate_and_the_steps_are_the_same_on_every_mesh(tmp_path):
    """3 SGD steps on one device, on data 8 and on data 4 x model 2: the same losses, KL
    estimates (one number from the whole batch: a psum over the batch axes), rewards and params.
    (Desirable examples weigh 10x more: the policy raises completions in general, so the KL
    estimate is positive, not clamped to 0.)"""
    files = labelled_completions(tmp_path / "k.jsonl", count=80)
    objective = KTO.default_config().set(desirable_weight=3.0, undesirable_weight=0.3)
    runs = []
    for shape, axes, devices in (((1,), ("data",), [0]), ((8,), ("data",), None),
                                 ((4, 2), ("data", "model"), None)):
        engine = _engine(files, shape=shape, axes=axes, devices=devices, objective=objective,
                         learner=helpers.sgd(2.0))
        engine.fit(steps=3)
        runs.append(({k: [h[k] for h in engine.history]
                      for k in ("loss", "kl", "rewards/chosen", "rewards/rejected")},
                     jax.tree_util.tree_map(np.asarray,
                                            jax.device_get(engine.canonical_params()))))
    (metrics, params), others = runs[0], runs[1:]
    assert max(metrics["kl"][1:]) > 0  # (The policy moved: a KL the loss uses.)
    for other_metrics, other_params in others:
        assert_close(other_metrics, metrics, what="losses, KL estimates and rewards")
        assert_close(other_params, params, what="params after 3 SGD steps")


def _write(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return str(path)


def test_bad_data_and_settings_are_refused_by_name(tmp_path):
    good = {"prompt": "a ->", "completion": " b.", "label": True}
    no_label = _write(tmp_path / "n.jsonl", [good, {"prompt": "a ->", "completion": " c."}])
    with pytest.raises(errors.DataError, match="no field 'label'") as info:
        _engine(no_label).fit(steps=1)
    assert "n.jsonl:2" in info.value.path
    text_label = _write(tmp_path / "t.jsonl", [good, dict(good, label="yes")])
    with pytest.raises(errors.DataError, match="must be true or false"):
        _engine(text_label).fit(steps=1)
    one = _write(tmp_path / "one.jsonl", [good])
    with pytest.raises(errors.DataError, match="KL estimate pairs"):
        UnpairedPreferences.default_config().set(files=[one], held_out_fraction=0.0
                                                 ).instantiate()
    with pytest.raises(errors.ConfigValidationError, match="beta"):
        KTO.default_config().set(beta=0.0).instantiate()
    files = labelled_completions(tmp_path / "k.jsonl", count=40)
    with pytest.raises(errors.ConfigError, match="no config.json") as info:
        _engine(files, objective=KTO.default_config().set(
            reference_from=str(tmp_path / "missing"))).build()
    assert info.value.path == "objective.reference_from"
    with pytest.raises(errors.PlanError, match="context_parallel") as info:
        _engine(files, mesh=helpers.mesh((2, 4), ("data", "context")),
                plan=Plan.default_config().set(
                    data_parallel=DP.default_config(),
                    context_parallel=CP.default_config().set(axis="context"))).build()


def test_an_objective_the_pipelines_cannot_stage_is_refused(tmp_path):
    """The seam's own refusal (train/objective.py), for every objective but the model's loss:
    a pipeline runs the model's forward in stages, not an objective's loss on whole rows."""
    from titanax.parallel.plan import PP  # pylint: disable=import-outside-toplevel
    files = labelled_completions(tmp_path / "k.jsonl", count=40)
    with pytest.raises(errors.PlanError, match="pipeline_parallel splits") as info:
        _engine(files, mesh=helpers.mesh((4, 2), ("data", "pipe")),
                plan=Plan.default_config().set(data_parallel=DP.default_config(),
                                               pipeline_parallel=PP.default_config())).build()
    assert info.value.path == "plan.pipeline_parallel"


def test_objective_and_data_must_agree(tmp_path):
    """Each objective reads its own records: KTO's labelled completions are not pairs, and
    pairs are not labelled completions."""
    files = labelled_completions(tmp_path / "k.jsonl", count=40)
    with pytest.raises(errors.ConfigError, match="trains on preference pairs") as info:
        _engine(files, objective=Preference.default_config()).build()
    assert info.value.path == "train_input.source"
    with pytest.raises(errors.ConfigError, match="reads labelled completions"):
        _engine(files, objective=Engine.default_config().objective).build()
    pairs = Input.default_config().set(
        source=PreferencePairs.default_config().set(files=[files], seq_len=32),
        global_batch_size=16)
    with pytest.raises(errors.ConfigError, match="trains on labelled completions"):
        _engine(files, train_input=pairs).build()


def test_a_record_is_cut_on_its_own_whatever_its_neighbours_completion(tmp_path):
    """Rows longer than seq_len are cut per row (as TRL's): a record's own row is the same next
    to a short or a long neighbour; a neighbour whose completion cannot be scored in the
    mismatched row only leaves the KL estimate."""
    rows = {}
    for name, neighbour in (("short", " ok."), ("long", " " + "x" * 40)):
        files = _write(tmp_path / f"{name}.jsonl", [
            {"prompt": "a b c d e f g h ->", "completion": " yes.", "label": True},
            {"prompt": "q ->", "completion": neighbour, "label": False}])
        source = UnpairedPreferences.default_config().set(
            files=[files], seq_len=16, held_out_fraction=0.0, seed=None).instantiate()
        rows[name] = source[0]
    for field in ("input_ids", "target_ids", "weights"):
        np.testing.assert_array_equal(rows["short"][field], rows["long"][field])
    assert rows["long"]["kl_weights"].sum() > 0


def test_an_objective_needs_the_engines_model_step(tmp_path):
    """No model, or a hand-written step: an objective would be ignored -- refused by name."""
    with pytest.raises(errors.ConfigError, match="hand-written step has none") as info:
        Engine.default_config().set(objective=KTO.default_config()).instantiate().build()
    assert info.value.path == "objective"
    files = labelled_completions(tmp_path / "k.jsonl", count=40)
    engine = _engine(files)
    engine.init_state()
    with pytest.raises(errors.StepError, match="computes its own loss") as info:
        engine.compile(lambda state, batch: (state, {}))
    assert info.value.path == "objective"
