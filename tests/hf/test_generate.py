"""Greedy generation with the key/value cache equals transformers' generate, token for token."""

import numpy as np
import pytest

from tests.hf import reference_models as ref

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_models")


def hf_greedy(directory, prompt_ids, new_tokens=NEW_TOKENS):
    """transformers' greedy tokens, and the smallest gap it saw between the best and the second
    best logit (a near tie could go either way in another float32 order)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor(prompt_ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             eos_token_id=None, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
    top2 = torch.stack(out.scores).topk(2, dim=-1).values
    gap = float((top2[..., 0] - top2[..., 1]).min())
    return out.sequences.numpy()[:, prompt_ids.shape[1]:], gap


@pytest.mark.parametrize("kind,data,model", [
    ("llama", 1, 1), ("llama", 4, 2), ("qwen3", 1, 1), ("qwen3", 4, 2), ("mistral", 2, 4),
    ("gpt2", 1, 1), ("gpt2", 4, 2),  # (GPT-2 decodes by the family's KV cache too.)
    # Layer patterns: a cache per member (Gated DeltaNet: its conv window and state).
    ("qwen3_sliding", 4, 2), ("qwen3_5", 1, 1), ("qwen3_5", 4, 2),
    # Gemma 3: a tail of layers after the stack, its own caches.
    ("gemma3", 1, 1), ("gemma3", 4, 2),
    # gpt-oss: sinks in every cached step, experts dropless.
    ("gpt_oss", 1, 1), ("gpt_oss", 4, 2),
    # DeepSeek-V3: the latent cache, a dense first layer's own cache.
    ("deepseek_v3", 1, 1), ("deepseek_v3", 4, 2),
    # Qwen 3.5 MoE: Gated DeltaNet's caches, experts and the gated shared expert.
    ("qwen3_5_moe", 1, 1), ("qwen3_5_moe", 4, 2)])
def test_greedy_tokens_equal_transformers(kind, data, model, root):
    import jax
    directory = ref.saved_model(kind, root)
    engine = ref.engine_for(directory, data=data, model=model)
    prompts = ref.token_ids(rows=4, length=7, seed=3)
    fn = engine.steps.generation(max_new_tokens=NEW_TOKENS)
    ours = np.asarray(fn(engine.state.params, prompts, jax.random.PRNGKey(0)))
    expected, gap = hf_greedy(directory, prompts)
    assert len(set(expected.ravel().tolist())) > 4, "a degenerate reference proves little"
    # Token equality is meaningful only away from ties: float32 orders differ by ~1e-6 here.
    assert gap > 1e-4, f"the reference came within {gap:.1e} of a tie: pick other prompts"
    mismatch = np.argwhere(ours != expected)
    assert mismatch.size == 0, f"first differing (row, position): {mismatch[:3].tolist()}"


def test_sampling_is_seeded_and_a_tiny_top_p_is_greedy(root):
    import jax
    engine = ref.engine_for(ref.saved_model("llama", root), data=4, model=2)
    prompts = ref.token_ids(rows=4, length=5, seed=4)
    greedy = engine.steps.generation(max_new_tokens=12)(engine.state.params, prompts,
                                                          jax.random.PRNGKey(0))
    sample = engine.steps.generation(max_new_tokens=12, temperature=1.0)
    first = np.asarray(sample(engine.state.params, prompts, jax.random.PRNGKey(1)))
    again = np.asarray(sample(engine.state.params, prompts, jax.random.PRNGKey(1)))
    other = np.asarray(sample(engine.state.params, prompts, jax.random.PRNGKey(2)))
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    assert not np.array_equal(first, np.asarray(greedy))
    assert first.min() >= 0 and first.max() < ref.VOCAB
    nucleus = engine.steps.generation(max_new_tokens=12, temperature=1.0, top_p=1e-6)
    assert np.array_equal(np.asarray(nucleus(engine.state.params, prompts,
                                             jax.random.PRNGKey(1))), np.asarray(greedy))


def test_generation_folds_pipe_and_hsdp_axes_into_data():
    from titanax.config import registry
    from titanax.train.saved_run import _data_and_model_only
    registry.load_config_modules(list(registry.DEFAULT_CONFIG_MODULES))
    for name, axes, shape in (("gpt_tiny_hsdp", ("data",), (None,)),
                              ("gpt_tiny_pp_tp", ("data", "model"), (None, 2))):
        run = registry.get_config(name)
        plan = run.plan.clone(pipeline_parallel=None, zero=None)
        mesh = _data_and_model_only(run.mesh, plan)
        assert (tuple(mesh.axes), tuple(mesh.shape)) == (axes, shape), name


@pytest.mark.parametrize("kind,data,model", [("llama", 4, 2), ("gpt2", 2, 1)])
def test_left_padded_prompts_of_different_lengths_sample_as_transformers(kind, data, model,
                                                                        root):
    """Prompts of 3..7 tokens left-padded into one batch: the greedy tokens equal transformers'
    (its attention mask and positions from it), and each token's reported log-prob and entropy
    equal those of transformers' logits at that step."""
    import jax
    import torch
    from transformers import AutoModelForCausalLM
    directory = ref.saved_model(kind, root)
    engine = ref.engine_for(directory, data=data, model=model)
    lengths = np.array([7, 3, 5, 4], np.int32)
    ids = ref.token_ids(rows=4, length=7, seed=5)
    mask = np.arange(7)[None, :] >= (7 - lengths)[:, None]
    prompts = np.where(mask, ids, 0).astype(np.int32)
    out = engine.steps.sampler(max_new_tokens=12)(engine.state.params, prompts, lengths,
                                                  jax.random.PRNGKey(0))
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor(prompts), attention_mask=torch.tensor(mask.astype(int)),
                           do_sample=False, max_new_tokens=12, min_new_tokens=12,
                           eos_token_id=None, pad_token_id=0, output_logits=True,
                           return_dict_in_generate=True)
    expected = want.sequences.numpy()[:, 7:]
    assert np.array_equal(np.asarray(out["tokens"]), expected)
    logps = torch.log_softmax(torch.stack(want.logits, 1), -1)
    want_logp = logps.gather(-1, torch.tensor(expected)[..., None])[..., 0].numpy()
    want_entropy = -(logps.exp() * logps).sum(-1).numpy()
    np.testing.assert_allclose(np.asarray(out["logps"]), want_logp, atol=1e-5 * max(
        1.0, np.abs(want_logp).max()))
    np.testing.assert_allclose(np.asarray(out["entropy"]), want_entropy, atol=1e-5 * max(
        1.0, want_entropy.max()))
    # Alone, each prompt (unpadded) gives its row's tokens.
    alone = engine.steps.generation(max_new_tokens=12)
    for row in range(0, 4, 2):
        real = ids[row:row + 1, 7 - lengths[row]:]
        got = np.asarray(alone(engine.state.params, np.repeat(real, data, 0),
                               jax.random.PRNGKey(0)))[0]
        assert np.array_equal(got, expected[row])
