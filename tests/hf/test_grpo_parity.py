"""Each GRPO variant's loss and gradient against TRL's own GRPO loss code (``trl`` as a
test-only reference): ``GRPOTrainer._compute_loss`` on fixed completions, advantages and old /
reference log-probs, with the variant's options (``loss_type``, ``importance_sampling_level``,
``epsilon`` / ``epsilon_high``, ``beta``, ``temperature``), a tiny random Llama under torch;
Titanax's GRPO objective's loss on the same rows, the same weights. The gradients are
compared leaf by leaf in transformers' names and layout (Titanax's exported through the HF
exporter, as a model's weights are)."""

import jax
import numpy as np
import pytest

from tests.numerics import assert_close
from titanax.hf import exporter, importer
from titanax.modules.context import flat_summaries
from titanax.agents.rows import episode_rows
from titanax.objectives.agent import Agent
from titanax.objectives.grpo import GRPO
from titanax.rl.rows import rollout_rows

ROWS, PROMPT, COMPLETION, TEMPERATURE = 4, 5, 6, 0.7
# Per variant: Titanax's settings, and TRL's GRPOConfig options for the same loss.
VARIANTS = {
    "grpo": ({"loss": "grpo", "beta": 0.04},
             {"loss_type": "grpo", "beta": 0.04, "epsilon": 0.2}),
    "dr_grpo": ({"loss": "dr_grpo"}, {"loss_type": "dr_grpo", "beta": 0.0, "epsilon": 0.2}),
    "dapo": ({"loss": "dapo"},
             {"loss_type": "dapo", "beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.28}),
    "gspo": ({"loss": "gspo"},
             {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.0,
              "epsilon": 3e-4, "epsilon_high": 4e-4}),
    # Rollouts sampled ahead (max_staleness 1), the truncated importance correction: TRL's
    # vLLM correction ("token_truncate"), its ratio to the policy at the update.
    "grpo_stale": ({"loss": "grpo", "beta": 0.04, "max_staleness": 1, "importance_cap": 1.1,
                    "importance_correction": "truncated"},
                   {"loss_type": "grpo", "beta": 0.04, "epsilon": 0.2}),
}
# The stale variant's cap (its "old" log-probs are the sampler's: some weights pass the cap).
CAP = 1.1


def _save_llama(directory, seed):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        eos_token_id=1, pad_token_id=2, bos_token_id=None, tie_word_embeddings=False,
        initializer_range=0.2)).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """``(policy dir, reference dir)``: two tiny random Llamas."""
    root = tmp_path_factory.mktemp("grpo")
    return _save_llama(str(root / "policy"), 0), _save_llama(str(root / "reference"), 1)


def _logps(directory, ids):
    """Per completion token, its log-prob under the model at ``directory`` (TEMPERATURE)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor(ids)).logits
    return torch.log_softmax(logits[:, PROMPT - 1:-1] / TEMPERATURE, -1).gather(
        -1, torch.tensor(ids[:, PROMPT:])[..., None])[..., 0].numpy().astype(np.float64)


def _inputs(dirs):
    """Fixed completions (two end early), advantages, old log-probs near the policy's own (so
    some ratios clip and some do not), and the reference model's log-probs."""
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(3, 64, (ROWS, PROMPT))
    completion_ids = rng.integers(3, 64, (ROWS, COMPLETION))
    mask = np.ones((ROWS, COMPLETION), np.int64)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    ids = np.concatenate([prompt_ids, completion_ids], 1)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "mask": mask,
            "advantages": np.array([1.3, -0.7, 0.4, -1.1]),
            "policy": _logps(dirs[0], ids),
            "old": _logps(dirs[0], ids) + rng.normal(0, 0.15, (ROWS, COMPLETION)),
            "ref": _logps(dirs[1], ids)}


def _trl(variant, data, policy_dir, tmp_path, *, tool_mask=None,
         max_completion_length=COMPLETION):
    """TRL's loss and its gradients by transformers' names; ``tool_mask``: 0 at the
    completion's tokens an environment wrote (TRL's multi-turn mask)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models as tok_models
    from trl import GRPOConfig, GRPOTrainer
    vocab = {f"t{i}": i for i in range(64)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(tok_models.WordLevel(vocab=vocab, unk_token="t0")),
        unk_token="t0", eos_token="t1", pad_token="t2")
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        train_dataset=Dataset.from_list([{"prompt": "t3 t4"}] * 8), processing_class=tokenizer,
        args=GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=ROWS,
                        num_generations=2, max_completion_length=max_completion_length,
                        temperature=TEMPERATURE, report_to=[], use_cpu=True, bf16=False,
                        fp16=False, **VARIANTS[variant][1]))
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    t = lambda x, dtype=torch.float32: torch.tensor(np.asarray(x), dtype=dtype)  # noqa: E731
    inputs = {"prompt_ids": t(data["prompt_ids"], torch.long),
              "prompt_mask": torch.ones(ROWS, PROMPT, dtype=torch.long),
              "completion_ids": t(data["completion_ids"], torch.long),
              "completion_mask": t(data["mask"], torch.long),
              "advantages": t(data["advantages"]), "old_per_token_logps": t(data["old"]),
              "ref_per_token_logps": t(data["ref"]),
              "num_items_in_batch": t(data["mask"].sum())}
    if tool_mask is not None:
        inputs["tool_mask"] = t(tool_mask, torch.long)
        inputs["num_items_in_batch"] = t((data["mask"] * tool_mask).sum())
    if variant == "grpo_stale":
        # As TRL's generation step computes them with vLLM: the ratio to the policy now (no
        # old log-probs), and each token's weight min(exp(policy - sampler), cap).
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
        inputs["old_per_token_logps"] = None
        inputs["importance_sampling_ratio"] = t(np.minimum(
            np.exp(data["policy"] - data["old"]), CAP) * data["mask"])
    loss = trainer._compute_loss(trainer.model, inputs)  # pylint: disable=protected-access
    loss.backward()
    grads = {name: p.grad.detach().numpy().astype(np.float64)
             for name, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}  # pylint: disable=protected-access
    return float(loss), grads, metrics


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_loss_and_gradients_equal_trls(variant, dirs, tmp_path):
    data = _inputs(dirs)
    want = _trl(variant, data, dirs[0], tmp_path)
    objective = GRPO.default_config().set(
        reward_functions=["math.isfinite"], temperature=TEMPERATURE,
        max_new_tokens=COMPLETION, **VARIANTS[variant][0]).instantiate()
    batch = rollout_rows(prompt_ids=data["prompt_ids"], prompt_lengths=np.full(ROWS, PROMPT),
                         completion_ids=data["completion_ids"], completion_mask=data["mask"],
                         old_logps=data["old"], advantages=data["advantages"],
                         row_weights=np.ones(ROWS))
    _check_against_trl(objective, batch, want, dirs=dirs, tmp_path=tmp_path, variant=variant)


# The tokens an environment wrote inside each completion (TRL's tool_mask 0): a tool's result
# between two model turns, a user's reply, none.
TOOL_SPANS = {0: (2, 4), 1: (1, 2), 2: (3, 5)}


@pytest.mark.parametrize("variant", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_a_multi_turn_episodes_loss_equals_trls_with_its_tool_mask(variant, dirs, tmp_path):
    """The agent objective on episode rows (titanax/agents/rows.py: the environment's tokens
    untrained) against TRL's loss with ``tool_mask`` 0 at the same tokens; Dr. GRPO's
    normaliser is the episode's token budget (``objective.max_tokens``), TRL's
    ``max_completion_length`` set to it."""
    data = _inputs(dirs)
    tool_mask = np.ones((ROWS, COMPLETION), np.int64)
    for row, (start, stop) in TOOL_SPANS.items():
        tool_mask[row, start:stop] = 0
    budget = PROMPT + COMPLETION
    want = _trl(variant, data, dirs[0], tmp_path, tool_mask=tool_mask,
                max_completion_length=budget)
    objective = Agent.default_config().set(
        environment="tests.agents.environments.Digits", temperature=TEMPERATURE,
        max_tokens=budget, **VARIANTS[variant][0]).instantiate()
    episodes = []
    for row in range(ROWS):
        length = PROMPT + int(data["mask"][row].sum())
        ids = np.concatenate([data["prompt_ids"][row], data["completion_ids"][row]])[:length]
        trained = np.concatenate([np.zeros(PROMPT, bool), tool_mask[row] > 0])[:length]
        logps = np.concatenate([np.zeros(PROMPT), data["old"][row]])[:length]
        episodes.append((ids, trained, np.where(trained, logps, 0.0)))
    batch = episode_rows(episodes, length=budget, advantages=data["advantages"],
                         row_weights=np.ones(ROWS))
    _check_against_trl(objective, batch, want, dirs=dirs, tmp_path=tmp_path, variant=variant)


def _check_against_trl(objective, batch, want, *, dirs, tmp_path, variant):
    """``objective``'s loss, gradients and clip / KL metrics on ``batch`` against TRL's
    (``want``: ``_trl``'s)."""
    import glob
    from safetensors.numpy import load_file
    want_loss, want_grads, trl_metrics = want
    model_cfg = importer.model_config(dirs[0])
    model = model_cfg.instantiate()
    policy = importer.params_as_numpy(dirs[0])
    reference = importer.params_as_numpy(dirs[1]) if objective.needs_reference else None

    def loss_of(p):
        params = p if reference is None else dict(p, reference=reference)
        (loss, aux), collection = objective.loss(model, params, batch, key=None,
                                                 is_training=True)
        return loss, (aux, flat_summaries(collection.summaries))

    (got, (aux, summaries)), grads = jax.value_and_grad(loss_of, has_aux=True)(policy)
    assert_close(float(got), want_loss, bound=1e-5, what=f"{variant} loss vs TRL's")
    exported = tmp_path / "grads"
    exporter.export_params(jax.device_get(grads), model_cfg=model_cfg, directory=str(exported))
    ours = {}
    for path in glob.glob(str(exported / "*.safetensors")):
        ours.update({k: v.astype(np.float64) for k, v in load_file(path).items()})
    assert set(ours) == set(want_grads)
    assert_close(ours, want_grads, bound=1e-5, scale="tree", what=f"{variant} gradients")
    assert max(np.abs(g).max() for g in want_grads.values()) > 1e-3, \
        "a gradient this small proves little"
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean") + (
            ("kl",) if objective.needs_reference else ()):
        assert_close(float(summaries[f"summaries/metrics/{name}"]), trl_metrics[name],
                     bound=1e-5, scale="tree", what=f"{variant} {name}")
    count = aux.get("num_tokens", aux.get("num_examples"))
    assert float(aux["loss_sum"]) == pytest.approx(float(got) * float(count))
