"""Fixtures of the agents tests: a small BPE with ChatML's special tokens and a chat template
that lists tools as Qwen's templates do."""

import json

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from titanax.data import train_tokenizer

# ChatML with tools as Qwen's templates write them: the tools' schemas in the system turn, a
# tool's response as a user turn inside <tool_response>.
TOOLS_CHATML = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}\n\n{% endif %}# Tools\n\n<tools>{% for tool in tools %}"
    "{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """The BPE and its template, as a tokenizer directory."""
    out = str(tmp_path_factory.mktemp("tools_tok"))
    train_tokenizer.train(train_tokenizer.corpus_files()[:3], vocab_size=400, out=out,
                          progress=False)
    hf = HFTokenizer.from_file(f"{out}/tokenizer.json")
    hf.add_special_tokens([AddedToken("<|im_start|>", special=True),
                           AddedToken("<|im_end|>", special=True)])
    hf.save(f"{out}/tokenizer.json")
    with open(f"{out}/tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump({"chat_template": TOOLS_CHATML, "eos_token": "<|im_end|>",
                   "bos_token": None, "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return out
