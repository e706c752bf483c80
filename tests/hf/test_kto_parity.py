"""KTO against TRL's own ``KTOTrainer`` (``trl`` as a test-only reference): the same tiny random
Llama as policy, another as reference (policy != reference), the same labelled completions as
TRL tokenizes and batches them -- its mismatched KL rows included. Titanax's KTO objective on
TRL's rows gives TRL's loss and metrics."""

import numpy as np
import pytest

from tests.hf.test_preference_parity import models  # noqa: F401  pylint: disable=unused-import
from tests.numerics import assert_close
from titanax.hf import importer
from titanax.modules.context import flat_summaries
from titanax.objectives.kto import KTO

RECORDS = [{"prompt": "2+3=", "completion": "5", "label": True},
           {"prompt": "a b ->", "completion": " b a.", "label": False},
           {"prompt": "Say hi:", "completion": " hello there", "label": True},
           {"prompt": "x y ->", "completion": " x y.", "label": False},
           {"prompt": "1+1=", "completion": " two", "label": False}]
METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
           "logps/rejected")


def _trl(options, tokenizer, policy_dir, reference_dir, tmp_path):
    """``(TRL's loss, its metrics, Titanax rows of its batch)``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import KTOConfig, KTOTrainer
    torch.manual_seed(0)
    policy, reference = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
                         for d in (policy_dir, reference_dir))
    trainer = KTOTrainer(
        model=policy, ref_model=reference, train_dataset=Dataset.from_list(RECORDS),
        processing_class=tokenizer,
        args=KTOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(RECORDS),
                       report_to=[], use_cpu=True, max_length=32, bf16=False, fp16=False,
                       **options))
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.eval()
    with torch.no_grad():
        value = trainer._compute_loss(trainer.model, batch, False)  # pylint: disable=protected-access
    metrics = {k: v[-1] for k, v in trainer._metrics["eval"].items()}  # pylint: disable=protected-access
    length = max(batch["input_ids"].shape[1], batch["KL_input_ids"].shape[1])
    ours = {}
    for prefix, ids, scored in (("", "input_ids", "completion_mask"),
                                ("kl_", "KL_input_ids", "KL_completion_mask")):
        # (Both row sets padded to one length with 0s, after the end: causal rows ignore it.)
        ids, scored = (np.pad(batch[k].numpy(), ((0, 0), (0, length - batch[k].shape[1])))
                       for k in (ids, scored))
        ours[prefix + "input_ids"] = ids[:, :-1].astype(np.int32)
        ours[prefix + "target_ids"] = ids[:, 1:].astype(np.int32)
        ours[prefix + "weights"] = scored[:, 1:].astype(np.float32)
    ours["label"] = batch["label"].numpy().astype(np.float32)
    return float(value), metrics, ours


@pytest.mark.parametrize("options", [{"beta": 0.1},
                                     {"beta": 0.5, "desirable_weight": 1.3,
                                      "undesirable_weight": 0.7}], ids=["default", "weighted"])
def test_the_loss_and_metrics_equal_trls(models, options, tmp_path):  # noqa: F811
    tokenizer, policy_dir, reference_dir = models
    want, metrics, batch = _trl(options, tokenizer, policy_dir, reference_dir, tmp_path)
    objective = KTO.default_config().set(**options).instantiate()
    model = importer.model_config(policy_dir).instantiate()
    params = dict(importer.params_as_numpy(policy_dir),
                  reference=importer.params_as_numpy(reference_dir))
    (got, aux), collection = objective.loss(model, params, batch, key=None, is_training=False)
    summaries = flat_summaries(collection.summaries)
    assert_close(float(got), want, bound=1e-5, what="KTO loss vs TRL's")
    assert metrics["kl"] > 0.1  # (A KL the loss uses: policy != reference.)
    got_metrics = {name: float(summaries[f"summaries/metrics/{name}"]) for name in METRICS}
    for name in ("kl", "logps/chosen", "logps/rejected"):
        assert_close(got_metrics[name], metrics[name], bound=1e-5, what=f"{name} vs TRL's")
    # A reward is beta x a difference of two log-probs: float32 sums' error is of their size.
    scale = options["beta"] * max(abs(metrics["logps/chosen"]), abs(metrics["logps/rejected"]))
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(got_metrics[name] - metrics[name]) <= 1e-5 * scale, \
            (name, got_metrics[name], metrics[name])
    assert float(aux["num_examples"]) == len(RECORDS)
