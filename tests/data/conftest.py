"""Fixtures of the data tests."""

import json

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from titanax.data import train_tokenizer

# ChatML, with the assistant's text and its end marker inside {% generation %}.
MARKED = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}"
          "<|im_end|>\n{% endgeneration %}{% else %}{{ message['content'] }}<|im_end|>\n"
          "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% endif %}")


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory):
    """A small BPE with ChatML's two special tokens and the marked template."""
    out = str(tmp_path_factory.mktemp("chat_tok"))
    train_tokenizer.train(train_tokenizer.corpus_files()[:3], vocab_size=400, out=out,
                          progress=False)
    tokenizer = HFTokenizer.from_file(f"{out}/tokenizer.json")
    tokenizer.add_special_tokens([AddedToken("<|im_start|>", special=True),
                                  AddedToken("<|im_end|>", special=True)])
    tokenizer.save(f"{out}/tokenizer.json")
    with open(f"{out}/tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump({"chat_template": MARKED, "eos_token": "<|im_end|>", "bos_token": None,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return out
