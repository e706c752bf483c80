"""An unset model vocabulary takes the train input's declared size (``train/inputs.py``)."""

from __future__ import annotations

import logging
import os

import pytest

from titanax import errors
from titanax.data.pipeline import Input
from titanax.data.sources import TextWindows
from titanax.modules.models.decoder import Decoder
from titanax.train.engine import Engine
from titanax.train.inputs import vocab_from_train_input
from tests import forked_python
from tests.environment import child_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _engine_config(*, vocab_size, tokenizer_path=None, files=None):
    model = Decoder.default_config().set(name="model", vocab_size=vocab_size, max_seq_len=32,
                                         num_layers=1, model_dim=16, num_heads=2, hidden_dim=32)
    source = TextWindows.default_config().set(seq_len=16, held_out_fraction=0.0)
    if files is not None:
        source.files = files
    train = Input.default_config().set(source=source, global_batch_size=8)
    train.tokenizer.path = tokenizer_path
    return Engine.default_config().set(model=model, train_input=train)


def test_an_unset_vocabulary_is_the_tokenizers_and_the_run_says_so(tmp_path, caplog):
    from titanax.data import train_tokenizer
    text = tmp_path / "corpus.txt"
    text.write_text("to be or not to be, that is the question. " * 200)
    train_tokenizer.train([str(text)], vocab_size=300, out=str(tmp_path / "tok"), progress=False)
    from titanax.data.tokenizer import Tokenizer
    size = Tokenizer.default_config().set(path=str(tmp_path / "tok")).instantiate().vocab_size
    assert 256 < size <= 300
    with caplog.at_level(logging.INFO, logger="titanax"):
        sized = vocab_from_train_input(_engine_config(
            vocab_size=None, tokenizer_path=str(tmp_path / "tok"), files=[str(text)]))
    assert sized.model.vocab_size == size
    assert f"model.vocab_size unset: {size}" in caplog.text and "tokenizer.json" in caplog.text
    bytes_sized = vocab_from_train_input(_engine_config(vocab_size=None))
    assert bytes_sized.model.vocab_size == 256
    # A size that is set stays, whatever the tokenizer (the declaration check refuses a small one).
    assert vocab_from_train_input(_engine_config(vocab_size=1000)).model.vocab_size == 1000
    # The Engine completes its own config the same way, however it is built.
    assert Engine(_engine_config(vocab_size=None)).config.model.vocab_size == 256
    assert _engine_config(vocab_size=None).instantiate().config.model.vocab_size == 256
    unsized = _engine_config(vocab_size=None)
    assert Engine(model=unsized.model, train_input=unsized.train_input
                  ).config.model.vocab_size == 256


def test_an_unset_vocabulary_with_nothing_to_take_it_from_names_the_field():
    config = _engine_config(vocab_size=None).set(train_input=None)
    with pytest.raises(errors.ConfigValidationError, match="no train input declares") as info:
        vocab_from_train_input(config).validate()
    assert "model.vocab_size" in str(info.value)


def test_the_launcher_sizes_the_model_from_its_tokenizer():
    """``--config.model.vocab_size=None`` through the real command: the resolved config holds
    the byte tokenizer's 256."""
    out = forked_python.run(
        ["-m", "titanax.launch", "--config=llama_tiny_dp_tp",
         "--config.model.vocab_size=None", "--print_config"],
        cwd=REPO_ROOT, env=child_environment(keep_device_count=True), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "model.vocab_size unset: 256" in out.stdout + out.stderr
    assert "model.vocab_size: 256" in out.stdout
