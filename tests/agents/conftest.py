"""Fixtures of the agents tests: a small BPE with ChatML's special tokens and a chat template
that lists tools as Qwen's templates do."""

import pytest

from tests import chatml_tokenizer

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
    return chatml_tokenizer.write(str(tmp_path_factory.mktemp("tools_tok")),
                                  template=TOOLS_CHATML)
