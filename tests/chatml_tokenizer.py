"""A small BPE with ChatML's two special tokens and a given chat template, as a tokenizer
directory: what the data and agents tests render conversations with (nothing downloaded)."""

import json

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from titanax.data import train_tokenizer


def write(out: str, *, template: str) -> str:
    """Trains the BPE (400 ids) on the bundled corpus into ``out``, adds ``<|im_start|>`` and
    ``<|im_end|>`` (the end of sequence) and ``template``; returns ``out``."""
    train_tokenizer.train(train_tokenizer.corpus_files()[:3], vocab_size=400, out=out,
                          progress=False)
    tokenizer = HFTokenizer.from_file(f"{out}/tokenizer.json")
    tokenizer.add_special_tokens([AddedToken("<|im_start|>", special=True),
                                  AddedToken("<|im_end|>", special=True)])
    tokenizer.save(f"{out}/tokenizer.json")
    with open(f"{out}/tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump({"chat_template": template, "eos_token": "<|im_end|>", "bos_token": None,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return out
