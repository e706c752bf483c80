"""The traps a newcomer met fine-tuning a Hugging Face model, through the real commands: each is
refused by name before the first step, or no longer a trap.

(The whole journey -- init_from carrying the tokenizer, chat prompts, export -- is
``tests/test_fine_tune_doc.py``.)
"""

import json
import os
import shutil
import sys

import pytest

from tests import forked_python
from tests.environment import child_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))


def _run(module, *args, expect=0):
    result = forked_python.run(["-m", module, *args], cwd=REPO_ROOT,
                               env=child_environment(quick_backend=True), timeout=600)
    assert result.returncode == expect, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny HF Llama with a 384-token BPE tokenizer and a chat template, and chat JSONL."""
    import tiny_chat_model  # pylint: disable=import-outside-toplevel  (examples/)
    return tiny_chat_model.write(str(tmp_path_factory.mktemp("tiny_chat")))


def test_a_tokenizer_larger_than_the_model_is_refused_before_the_first_step(chat_model,
                                                                           tmp_path):
    """llama_tiny_packed's model has 256 ids; the tokenizer 384 (before: refused at the first
    batch that happened to hold an id past 255 -- or hundreds of steps later)."""
    result = _run("titanax.launch", "--config=llama_tiny_packed", "--cpu_devices=8",
                  f"--trainer_dir={tmp_path / 'run'}",
                  f"--config.train_input.tokenizer.path={chat_model['model']}",
                  "--config.train_input.source.format=chat",
                  f"--config.train_input.source.files=['{chat_model['data']}']", expect=2)
    assert "model.vocab_size: train_input reads ids up to 383" in result.stderr
    assert "(384 tokens)" in result.stderr and "at least 384" in result.stderr
    assert "step " not in result.stdout and not (tmp_path / "run").exists()  # (Nothing left.)


def test_an_unset_vocabulary_with_init_from_is_the_checkpoints(chat_model):
    """``model.vocab_size=None`` asks for the data's vocabulary; with init_from the model's
    table (config.json: 384) is it -- not left unset again by the override."""
    result = _run("titanax.launch", "--config=llama_tiny_sft", "--cpu_devices=8",
                  f"--config.init_from={chat_model['model']}",
                  "--config.train_input.source.format=chat",
                  f"--config.train_input.source.files=['{chat_model['data']}']",
                  "--config.model.vocab_size=None", "--print_config")
    assert "model.vocab_size: 384" in result.stdout


def test_rows_longer_than_the_models_positions_are_refused_before_the_first_step(tmp_path):
    result = _run("titanax.launch", "--config=llama_tiny_packed", "--cpu_devices=8",
                  f"--trainer_dir={tmp_path / 'run'}",
                  "--config.train_input.source.seq_len=128", expect=2)
    assert "model.max_seq_len: train_input makes rows of 128 positions" in result.stderr
    assert "step " not in result.stdout


def test_a_config_json_that_disagrees_with_the_tensors_is_refused_not_padded(chat_model,
                                                                            tmp_path):
    """config.json says 400 tokens, the embedding has 384 rows: before, the missing rows were
    padded with zeros and the run trained."""
    directory = tmp_path / "model"
    shutil.copytree(chat_model["model"], directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "vocab_size": 400}))
    result = _run("titanax.launch", "--config=llama_tiny_sft", "--cpu_devices=8",
                  f"--trainer_dir={tmp_path / 'run'}", f"--config.init_from={directory}",
                  "--config.train_input.source.format=chat",
                  f"--config.train_input.source.files=['{chat_model['data']}']", expect=2)
    assert ("tensor 'model.embed_tokens.weight' has shape (384, 64); config.json implies "
            "(400, 64) (Titanax param token_emb/weight)") in result.stderr
    assert "step " not in result.stdout


def test_a_run_that_read_bytes_exports_no_tokenizer_beside_its_weights(chat_model, tmp_path):
    """The user chose bytes over the model's tokenizer (``tokenizer.path=None``): the export
    must not ship the BPE tokenizer as if the weights had learned its ids."""
    run = tmp_path / "run"
    trained = _run("titanax.launch", "--config=llama_tiny_dp_tp", "--cpu_devices=8",
                   f"--trainer_dir={run}", f"--config.init_from={chat_model['model']}",
                   "--config.train_input.tokenizer.path=None", "--config.max_steps=2",
                   "--config.evalers={}")
    assert "data tokenized with" not in trained.stdout
    exported = _run("titanax.export", f"--trainer_dir={run}", f"--to={tmp_path / 'export'}",
                    "--cpu_devices=8")
    assert "the run read bytes" in exported.stdout
    files = set(os.listdir(tmp_path / "export"))
    assert "tokenizer.json" not in files and "generation_config.json" in files, files


def test_a_base_models_tokenizer_renders_chats_only_with_a_named_template(chat_model, tmp_path):
    """A directory whose tokenizer ships no chat template (a base model's): chat records are
    refused (a format of ours would be one transformers cannot render for it); naming one
    (``tokenizer.chat_template=plain``) keeps the model's tokenizer -- setting a tokenizer field
    is not choosing bytes -- and both exports (merged; PEFT, beside its adapters) carry the
    template, rendered by transformers."""
    base = tmp_path / "base"
    shutil.copytree(chat_model["model"], base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    flags = ["--config=llama_tiny_lora_sft", "--cpu_devices=8",
             f"--trainer_dir={tmp_path / 'run'}",
             f"--config.init_from={base}", "--config.train_input.source.format=chat",
             f"--config.train_input.source.files=['{chat_model['data']}']",
             "--config.max_steps=2", "--config.evalers={}"]
    refused = _run("titanax.launch", *flags, expect=2)
    assert "train_input.tokenizer.chat_template: " in refused.stderr
    assert "ships no chat template" in refused.stderr and not (tmp_path / "run").exists()
    trained = _run("titanax.launch", *flags, "--config.train_input.tokenizer.chat_template=plain")
    assert f"data tokenized with the model's tokenizer {base}/tokenizer.json" in trained.stdout
    from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
    for out, export_format in (("merged", "merged"), ("adapter", "peft")):
        _run("titanax.export", f"--trainer_dir={tmp_path / 'run'}", f"--to={tmp_path / out}",
             f"--format={export_format}", "--cpu_devices=8")
        rendered = AutoTokenizer.from_pretrained(str(tmp_path / out)).apply_chat_template(
            [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
        assert rendered.endswith("### user\nHi\n\n### assistant\n"), (out, rendered)
