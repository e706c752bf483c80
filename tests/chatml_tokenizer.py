"""A small BPE with a chat format's special tokens (ChatML's two by default) and a given chat
template, as a tokenizer directory: what the data and agents tests render conversations with
(nothing downloaded)."""

import json

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from titanax.data import train_tokenizer


def write(out: str, *, template: str, specials=("<|im_start|>", "<|im_end|>"),
          eos: str = "<|im_end|>", bos=None) -> str:
    """Trains the BPE (400 ids) on the bundled corpus into ``out``, adds the ``specials``
    (``eos`` the end of sequence, ``bos`` the start) and ``template``; returns ``out``."""
    train_tokenizer.train(train_tokenizer.corpus_files()[:3], vocab_size=400, out=out,
                          progress=False)
    tokenizer = HFTokenizer.from_file(f"{out}/tokenizer.json")
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in specials])
    tokenizer.save(f"{out}/tokenizer.json")
    with open(f"{out}/tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump({"chat_template": template, "eos_token": eos, "bos_token": bos,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return out
