"""Fixtures of the data tests."""

import pytest

from tests import chatml_tokenizer

# ChatML, with the assistant's text and its end marker inside {% generation %}.
MARKED = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}"
          "<|im_end|>\n{% endgeneration %}{% else %}{{ message['content'] }}<|im_end|>\n"
          "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% endif %}")


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory):
    """A small BPE with ChatML's two special tokens and the marked template."""
    return chatml_tokenizer.write(str(tmp_path_factory.mktemp("chat_tok")), template=MARKED)
