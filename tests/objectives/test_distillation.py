"""On-policy distillation through the engine: the loss is the same chunked and unchunked, and on one device, data 8, data 4 x model 2
and FSDP 8; its temporaries do not grow with the vocabulary; bad teachers and settings are
refused by name. (Its numbers against TRL's generalized JSD: tests/hf/test_distillation_parity.py;
the interface command -- a student's reverse KL falling by more than 30% in 200 steps, the
student exported -- walked in docs/distillation.md: tests/test_distillation_doc.py.)
"""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from tests.numerics import assert_close
from tests.train import helpers
from titanax import errors
from titanax.data.pipeline import Input
from titanax.data.prompts import Prompts
from titanax.hf import importer
from titanax.objectives.distillation import Distillation
from titanax.parallel.plan import DP, TP, Plan, ZeRO
from titanax.rl.rows import rollout_rows
from titanax.train.engine import Engine

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUMS = os.path.join(REPO_ROOT, "titanax", "data", "bundled", "sums")


def hf_llama(directory, *, seed, width, init, vocab=16, tokenizer=SUMS):
    """A tiny random Llama as an HF directory with the bundled sums tokenizer (16 tokens)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        initializer_range=init, eos_token_id=2, bos_token_id=1,
        tie_word_embeddings=False)).save_pretrained(str(directory))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer, name), str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``(student dir, teacher dir)``: a near-uniform random student, a peaky wider teacher."""
    root = tmp_path_factory.mktemp("distill")
    return (hf_llama(root / "student", seed=0, width=32, init=0.02),
            hf_llama(root / "teacher", seed=1, width=64, init=0.5))


def _engine(models, *, shape=(8,), axes=("data",), devices=None, zero=None, chunk=None,
            **objective):
    student, teacher = models
    prompts = Input.default_config().set(
        source=Prompts.default_config().set(files=[os.path.join(SUMS, "prompts.jsonl")],
                                            max_prompt_tokens=5), global_batch_size=8)
    prompts.tokenizer.path = student
    cfg = Engine.default_config().set(
        mesh=helpers.mesh(shape, axes, devices=devices),
        plan=Plan.default_config().set(
            data_parallel=DP.default_config(), zero=zero,
            tensor_parallel=TP.default_config() if "model" in axes else None),
        model=importer.model_config(student).set(loss_chunk_tokens=chunk), init_from=student,
        train_input=prompts,
        objective=Distillation.default_config().set(**dict(dict(teacher_from=teacher,
                                                                max_new_tokens=6), **objective)),
        learner=helpers.sgd(0.5), loggers=[], log_every=1, max_steps=2)
    return cfg.instantiate()


def _rows():
    """Fixed rollout rows: 8 prompts of 5 tokens, completions of 6 (two end early)."""
    rng = np.random.default_rng(0)
    mask = np.ones((8, 6), np.int64)
    mask[1, 4:] = 0
    mask[5, 2:] = 0
    return rollout_rows(prompt_ids=rng.integers(3, 16, (8, 5)), prompt_lengths=np.full(8, 5),
                        completion_ids=rng.integers(3, 16, (8, 6)), completion_mask=mask,
                        old_logps=np.zeros((8, 6)), advantages=np.zeros(8),
                        row_weights=np.ones(8))


def _two_steps(engine):
    engine.init_or_restore()
    losses = [float(engine.train_step(_rows())["loss"]) for _ in range(2)]
    return losses, jax.tree_util.tree_map(np.asarray, jax.device_get(engine.canonical_params()))


def test_every_mesh_and_chunking_trains_alike(models):
    """2 SGD steps on the same rows: one device, data 8 (chunks of 7 tokens), data 4 x model 2
    (the vocabulary split) and FSDP 8 give the same losses and params."""
    losses, params = _two_steps(_engine(models, shape=(1,), devices=[0]))
    assert losses[1] < losses[0]
    for engine in (_engine(models, chunk=7),  # (Chunks that do not divide the rows' tokens.)
                   _engine(models, shape=(4, 2), axes=("data", "model")),
                   _engine(models, zero=ZeRO.default_config().set(stage=3, min_shard_size=16))):
        other_losses, other_params = _two_steps(engine)
        assert_close(other_losses, losses, what="losses")
        assert_close({k: v for k, v in other_params.items() if k != "teacher"},
                     {k: v for k, v in params.items() if k != "teacher"}, what="params")


def test_bad_teachers_and_settings_are_refused_by_name(models, tmp_path):
    with pytest.raises(errors.ConfigError, match="names no teacher") as info:
        _engine(models, teacher_from=None).build()
    assert info.value.path == "objective.teacher_from"
    with pytest.raises(errors.ConfigError, match="no config.json"):
        _engine(models, teacher_from=str(tmp_path)).build()
    wide = hf_llama(tmp_path / "wide", seed=2, width=32, init=0.02, vocab=20)
    with pytest.raises(errors.ConfigError, match="20 ids and the student's 16") as info:
        _engine(models, teacher_from=wide).build()
    assert info.value.path == "objective.teacher_from"
    other = tmp_path / "other_tokenizer"
    shutil.copytree(SUMS, other, ignore=shutil.ignore_patterns("*.jsonl"))
    with open(other / "tokenizer.json", encoding="utf-8") as f:
        spec = json.load(f)
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[5:7]  # Two ordinary tokens' ids swapped.
    vocab[first], vocab[second] = vocab[second], vocab[first]
    with open(other / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(spec, f)
    swapped = hf_llama(tmp_path / "swapped", seed=2, width=32, init=0.02, tokenizer=other)
    with pytest.raises(errors.ConfigError, match="tokenizer is not the student's") as info:
        _engine(models, teacher_from=swapped).build()
    assert info.value.path == "objective.teacher_from"
    with pytest.raises(errors.ConfigValidationError, match="beta"):
        Distillation.default_config().set(beta=1.5).instantiate()


def _word_level_tokenizer(directory, vocab):
    """A tokenizer.json of ``vocab`` word-level tokens (``<eos>`` id 1): what a student and its
    teacher share."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    tokens = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(tok_models.WordLevel(vocab=tokens, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token": "<eos>"}, f)


def _compiled_bytes(root, vocab):
    """--compile_only's report of a distillation run at ``vocab`` ids (data 4 x model 2: the
    vocabulary split), the teacher a config.json and the shared tokenizer (nothing loads)."""
    from transformers import LlamaConfig
    from titanax.modules.models.decoder import Decoder
    from titanax.train import abstract_compile
    teacher = os.path.join(root, f"teacher_{vocab}")
    _word_level_tokenizer(teacher, vocab)
    LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                eos_token_id=1, tie_word_embeddings=False).to_json_file(
                    os.path.join(teacher, "config.json"))
    prompts = Input.default_config().set(
        source=Prompts.default_config().set(files=["unused.jsonl"], max_prompt_tokens=64),
        global_batch_size=32)
    prompts.tokenizer.path = teacher
    engine = Engine.default_config().set(
        mesh=helpers.mesh((4, 2), ("data", "model")),
        plan=Plan.default_config().set(data_parallel=DP.default_config(),
                                       tensor_parallel=TP.default_config()),
        model=Decoder.default_config().set(
            name="llama", vocab_size=vocab, max_seq_len=128, num_layers=2, model_dim=32,
            num_heads=4, num_kv_heads=2, hidden_dim=64),
        train_input=prompts, objective=Distillation.default_config().set(
            teacher_from=teacher, max_new_tokens=64, num_generations=2),
        learner=helpers.adam(), loggers=[]).instantiate()
    return abstract_compile.compile_only(engine)


def test_temporaries_do_not_grow_with_the_vocabulary(tmp_path):
    """The train step's and the sampler's temporaries at 256 and at 131,072 ids (8,128 tokens a
    step, the student's and the teacher's heads chunked and split): within 512 MiB (measured:
    17 -> 155 MiB, the growth the vocabulary-sized params' gradients) -- each device's share of
    one model's whole logits would be 532 MiB at the larger vocabulary, 4.3 GB over the batch."""
    small, large = (_compiled_bytes(str(tmp_path), vocab) for vocab in (256, 131072))
    for name in ("temp_bytes", "sampler_temp_bytes"):
        assert large[name] - small[name] <= 512 * 2 ** 20, (name, small[name], large[name])
