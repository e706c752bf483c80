"""A tiny chat model to try the fine-tuning commands on, made here, nothing downloaded.

    python examples/tiny_chat_model.py --out=tiny_chat

writes ``tiny_chat/model/`` -- a Hugging Face directory as ``save_pretrained`` writes one: a
randomly initialised 2-layer Llama (``config.json``, ``model.safetensors``,
``generation_config.json``) with a byte-level BPE tokenizer trained on the data below
(``tokenizer.json``, ``tokenizer_config.json``) and a ChatML chat template
(``<|im_start|>role ... <|im_end|>``) -- and ``tiny_chat/chat.jsonl``: 400 conversations
``{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}`` asking for the sum of two
small numbers. ``docs/fine_tune.md`` walks from these to an exported model answering a chat
prompt; with your own model, use its directory and your own JSONL instead.

Needs ``torch`` and ``transformers`` (the ``dev`` extra), as a real model directory does.
"""

from __future__ import annotations

import argparse
import json
import os
import random

CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def conversations(count: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(count):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        yield {"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                            {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}


def write(out: str, *, records: int = 400, vocab_size: int = 384, seed: int = 0) -> dict:
    """Writes ``out/model`` and ``out/chat.jsonl``; returns their paths."""
    import torch  # pylint: disable=import-outside-toplevel
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
    from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM,  # pylint: disable=import-outside-toplevel
                              PreTrainedTokenizerFast)
    os.makedirs(out, exist_ok=True)
    data = os.path.join(out, "chat.jsonl")
    rows = list(conversations(records, seed))
    with open(data, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = [m["content"] for row in rows for m in row["messages"]]
    bpe.train_from_iterator(texts * 4, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", chat_template=CHATML)
    model_dir = os.path.join(out, "model")
    tokenizer.save_pretrained(model_dir)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.05, bos_token_id=None, eos_token_id=end,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False))
    model.generation_config = GenerationConfig(eos_token_id=end,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(model_dir)
    return {"model": model_dir, "data": data}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="Directory to write (model/, chat.jsonl).")
    args = parser.parse_args()
    paths = write(args.out)
    print(f"wrote {paths['model']} and {paths['data']}")


if __name__ == "__main__":
    main()
