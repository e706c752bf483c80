"""Every preference loss against TRL's own trainers (``trl`` as a test-only reference): the same
tiny random Llama as policy, another as reference (policy != reference), the same pairs as TRL
tokenizes and batches them -- TRL's DPOTrainer for sigmoid / ipo / hinge, its CPOTrainer
(``loss_type="simpo"``, no SFT term) for SimPO, its ORPOTrainer for ORPO. Titanax's
the Preference objective's loss on TRL's rows gives TRL's loss and rewards."""

import jax
import numpy as np
import pytest

from tests.numerics import assert_close
from titanax.hf import importer
from titanax.modules.context import flat_summaries
from titanax.objectives.preference import Preference

PAIRS = [{"prompt": "2+3=", "chosen": "5", "rejected": "six"},
         {"prompt": "a b ->", "chosen": " b a.", "rejected": " a b."},
         {"prompt": "Say hi:", "chosen": " hello there", "rejected": " no"}]
BETA = 0.1


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``(tokenizer, policy dir, reference dir)``: a character tokenizer (ids < 128) and two
    tiny random Llamas."""
    import torch
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    vocab = {**{chr(i): i for i in range(32, 127)}, "<unk>": 0, "<eos>": 1, "<pad>": 2}
    tok = Tokenizer(tok_models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                        eos_token="<eos>", pad_token="<pad>")
    root = tmp_path_factory.mktemp("preference")
    dirs = []
    for seed, name in ((0, "policy"), (1, "reference")):
        torch.manual_seed(seed)
        LlamaForCausalLM(LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            eos_token_id=1, pad_token_id=2, bos_token_id=None,
            initializer_range=0.2)).save_pretrained(str(root / name))
        dirs.append(str(root / name))
    return tokenizer, dirs[0], dirs[1]


def _trl(loss, tokenizer, policy_dir, reference_dir, tmp_path):
    """``(TRL's loss, its rewards, Titanax rows of its batch)``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    data = Dataset.from_list(PAIRS)
    common = dict(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(PAIRS),
                  report_to=[], beta=BETA, use_cpu=True, max_length=32,
                  # float32 throughout (TRL's configs default to bfloat16 autocast where the
                  # machine has it: its reference pass would run in bfloat16).
                  bf16=False, fp16=False)
    if loss in ("sigmoid", "ipo", "hinge"):
        from trl import DPOConfig, DPOTrainer
        reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32)
        trainer = DPOTrainer(model=policy, ref_model=reference, train_dataset=data,
                             processing_class=tokenizer,
                             args=DPOConfig(loss_type=[loss], **common))
        batch = next(iter(trainer.get_train_dataloader()))
        trainer.model.eval()
        with torch.no_grad():
            value = trainer._compute_loss(trainer.model, batch, False)  # pylint: disable=protected-access
        metrics = {k: v[-1] for k, v in trainer._metrics["eval"].items()}  # pylint: disable=protected-access
        ids, scored = batch["input_ids"].numpy(), batch["completion_mask"].numpy()
        real = batch["attention_mask"].numpy()
        half = len(PAIRS)
        rows = {"chosen": (ids[:half], scored[:half], real[:half]),
                "rejected": (ids[half:], scored[half:], real[half:])}
    else:
        if loss == "simpo":
            from trl.experimental.cpo import CPOConfig as Config, CPOTrainer as Trainer
            options = dict(loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.5)
        else:
            from trl.experimental.orpo import ORPOConfig as Config, ORPOTrainer as Trainer
            options = {}
        trainer = Trainer(model=policy, train_dataset=data, processing_class=tokenizer,
                          args=Config(**common, **options))
        batch = next(iter(trainer.get_train_dataloader()))
        trainer.model.eval()
        with torch.no_grad():
            value, metrics = trainer.get_batch_loss_metrics(trainer.model, batch, "train")
        rows = {side: (batch[f"{side}_input_ids"].numpy(),
                       (batch[f"{side}_labels"].numpy() != -100).astype(np.int64),
                       batch[f"{side}_attention_mask"].numpy())
                for side in ("chosen", "rejected")}
    ours = {}
    length = max(ids.shape[1] for ids, _, _ in rows.values())
    for side, (ids, scored, real) in rows.items():  # (Both sides padded to one length, 0s.)
        ids, scored, real = (np.pad(x, ((0, 0), (0, length - x.shape[1])))
                             for x in (ids, scored, real))
        ours[f"{side}_valid"] = real[:, 1:].astype(np.float32)
        ours[f"{side}_input_ids"] = ids[:, :-1].astype(np.int32)
        ours[f"{side}_target_ids"] = ids[:, 1:].astype(np.int32)
        ours[f"{side}_weights"] = scored[:, 1:].astype(np.float32)
    return float(value), {k: float(v) for k, v in metrics.items()}, ours


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge", "simpo", "orpo"])
def test_the_loss_and_rewards_equal_trls(models, loss, tmp_path):
    tokenizer, policy_dir, reference_dir = models
    want, metrics, batch = _trl(loss, tokenizer, policy_dir, reference_dir, tmp_path)
    objective = Preference.default_config().set(loss=loss, beta=BETA,
                                                simpo_gamma=0.5).instantiate()
    model = importer.model_config(policy_dir).instantiate()
    params = importer.params_as_numpy(policy_dir)
    if objective.needs_reference:
        params = dict(params, reference=importer.params_as_numpy(reference_dir))
    (got, aux), collection = objective.loss(model, params, batch, key=None, is_training=False)
    summaries = flat_summaries(collection.summaries)
    assert_close(float(got), want, bound=1e-5, what=f"{loss} loss vs TRL's")
    # The margin is chosen - rejected: its rounding is at the rewards' scale, not its own.
    rewards = ("rewards/chosen", "rewards/rejected", "rewards/margins")
    assert_close({name: float(summaries[f"summaries/metrics/{name}"]) for name in rewards},
                 {name: metrics[name] for name in rewards}, bound=1e-5, scale="tree",
                 what=f"{loss} rewards vs TRL's")
    assert float(summaries["summaries/metrics/rewards/accuracies"]) == \
        metrics["rewards/accuracies"], (summaries, metrics)
    assert float(aux["num_examples"]) == len(PAIRS)


@pytest.mark.parametrize("init_from", [True, False], ids=["policy-from-hf", "policy-random"])
def test_reference_from_loads_another_directory_as_the_frozen_reference(models, init_from):
    """``reference_from`` is the reference copy's weights, in the run's shards -- beside a
    policy from ``init_from`` (its own directory's weights) or from the initializers."""
    from tests.train import helpers
    from titanax.parallel.plan import DP, TP, Plan
    from titanax.train.engine import Engine
    _, policy_dir, reference_dir = models
    engine = Engine.default_config().set(
        mesh=helpers.mesh((4, 2), ("data", "model")),
        plan=Plan.default_config().set(data_parallel=DP.default_config(),
                                       tensor_parallel=TP.default_config()),
        model=importer.model_config(policy_dir), init_from=policy_dir if init_from else None,
        objective=Preference.default_config().set(reference_from=reference_dir),
        learner=helpers.adam(), loggers=[]).instantiate()
    engine.init_or_restore()
    params = jax.device_get(engine.canonical_params())
    want_policy = importer.params_as_numpy(policy_dir)
    want_reference = importer.params_as_numpy(reference_dir)
    if init_from:
        assert_close(helpers.flat({k: v for k, v in params.items() if k != "reference"}),
                     helpers.flat(want_policy), bound=0.0, what="the policy")
    assert_close(helpers.flat(params["reference"]), helpers.flat(want_reference), bound=0.0,
                 what="the reference")
