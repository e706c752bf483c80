"""On-policy distillation's loss and gradients against TRL's own generalized-JSD code
(``GKDTrainer.generalized_jsd_loss``; ``trl`` as a test-only reference) on fixed samples: a tiny
random Llama student and a wider teacher under torch, the divergence at every completion
position over the whole vocabulary (padded in Titanax's table: the padding must count nowhere),
at beta 0 (forward KL), 0.5 and 1 (reverse KL) and a sampling temperature. The gradients are
compared leaf by leaf in transformers' names (Titanax's exported through the HF exporter)."""

import glob

import jax
import numpy as np
import pytest

from tests.numerics import assert_close
from titanax.hf import exporter, importer
from titanax.modules.context import flat_summaries
from titanax.objectives import distillation
from titanax.objectives.distillation import Distillation
from titanax.rl.rows import rollout_rows

ROWS, PROMPT, COMPLETION, TEMPERATURE, VOCAB = 4, 5, 6, 0.7, 50


def _save_llama(directory, seed, width):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=width, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        eos_token_id=1, pad_token_id=2, bos_token_id=None, tie_word_embeddings=False,
        initializer_range=0.3)).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """``(student dir, teacher dir)``: two tiny random Llamas, the teacher wider."""
    root = tmp_path_factory.mktemp("distill")
    return _save_llama(str(root / "student"), 0, 32), _save_llama(str(root / "teacher"), 1, 48)


def _samples():
    """Fixed prompts and completions, two of which end early."""
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(3, VOCAB, (ROWS, PROMPT))
    completion_ids = rng.integers(3, VOCAB, (ROWS, COMPLETION))
    mask = np.ones((ROWS, COMPLETION), np.int64)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return prompt_ids, completion_ids, mask


def _trl(dirs, beta):
    """``(TRL's loss, its gradients by HF name)``: the student's and the teacher's logits of the
    next token at every completion position, through TRL's generalized JSD."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl.experimental.gkd import GKDTrainer
    student, teacher = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
                        for d in dirs)
    prompt_ids, completion_ids, mask = _samples()
    ids = torch.tensor(np.concatenate([prompt_ids, completion_ids], 1))
    labels = ids[:, 1:].clone()
    labels[:, :PROMPT - 1] = -100
    labels[:, PROMPT - 1:][torch.tensor(mask) == 0] = -100
    with torch.no_grad():
        teacher_logits = teacher(ids).logits[:, :-1]
    loss = GKDTrainer.generalized_jsd_loss(student(ids).logits[:, :-1], teacher_logits,
                                           labels=labels, beta=beta, temperature=TEMPERATURE)
    loss.backward()
    grads = {name: p.grad.detach().numpy().astype(np.float64)
             for name, p in student.named_parameters() if p.grad is not None}
    return float(loss), grads


# (0.3: the mixture's weights are not symmetric -- swapping them would show.)
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_the_loss_and_gradients_equal_trls(dirs, beta, tmp_path):
    from safetensors.numpy import load_file
    want_loss, want_grads = _trl(dirs, beta)
    # The table padded past the vocabulary: its padding rows must count nowhere.
    model_cfg = importer.model_config(dirs[0]).set(vocab_pad_multiple=64)
    model = model_cfg.instantiate()
    assert model.padded_vocab_size > VOCAB
    objective = Distillation.default_config().set(
        loss="jsd", beta=beta, temperature=TEMPERATURE, max_new_tokens=COMPLETION,
        teacher_from=dirs[1]).instantiate()
    objective.teacher = distillation._teacher_model(dirs[1], student=model)  # pylint: disable=protected-access
    teacher = importer.params_as_numpy(dirs[1], objective.teacher.config)
    prompt_ids, completion_ids, mask = _samples()
    batch = rollout_rows(prompt_ids=prompt_ids, prompt_lengths=np.full(ROWS, PROMPT),
                         completion_ids=completion_ids, completion_mask=mask,
                         old_logps=np.zeros((ROWS, COMPLETION)), advantages=np.zeros(ROWS),
                         row_weights=np.ones(ROWS))

    def loss_of(student):
        (loss, aux), collection = objective.loss(model, dict(student, teacher=teacher), batch,
                                                 key=None, is_training=True)
        return loss, (aux, flat_summaries(collection.summaries))

    (got, (aux, summaries)), grads = jax.value_and_grad(loss_of, has_aux=True)(
        importer.params_as_numpy(dirs[0], model_cfg))
    assert_close(float(got), want_loss, bound=1e-5, what=f"beta {beta} loss vs TRL's")
    exported = tmp_path / "grads"
    exporter.export_params(jax.device_get(grads), model_cfg=model_cfg, directory=str(exported))
    ours = {}
    for path in glob.glob(str(exported / "*.safetensors")):
        ours.update({k: v.astype(np.float64) for k, v in load_file(path).items()})
    assert set(ours) == set(want_grads)
    assert_close(ours, want_grads, bound=1e-5, scale="tree", what=f"beta {beta} gradients")
    assert max(np.abs(g).max() for g in want_grads.values()) > 1e-3
    assert float(aux["num_tokens"]) == mask.sum()
    if beta == 1.0:  # The reverse KL is the loss itself there.
        assert_close(float(summaries["summaries/metrics/reverse_kl"]), want_loss, bound=1e-5)
