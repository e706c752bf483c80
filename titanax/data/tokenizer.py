"""Tokenizers: bytes (the default for the bundled corpus), or a Hugging Face ``tokenizer.json``.

``ByteTokenizer``: every UTF-8 byte is a token (vocabulary 256), so any text round-trips and no
file is needed. ``Tokenizer`` (a config) loads a ``tokenizer.json`` -- written by
``python -m titanax.data.train_tokenizer`` or shipped with a Hugging Face model -- through the
``tokenizers`` package, with the BOS / EOS ids the model expects (from the JSON's special tokens
or the directory's ``tokenizer_config.json``). Its ``path`` left unset gives the byte tokenizer.
Conversations are rendered with the tokenizer's chat template (``chat.py``).
"""

from __future__ import annotations

import logging
import os
from typing import Any, List, Optional, Sequence

import numpy as np

from titanax import errors
from titanax.config import Configurable
from titanax.data import chat
from titanax.io.files import read_json_object

TOKENIZER_FILE = "tokenizer.json"

_log = logging.getLogger("titanax")

# Special tokens that mark a document boundary when a tokenizer.json has no other.
BOUNDARY_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


class ByteTokenizer:
    """Text <-> uint8 ids."""

    vocab_size = 256
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


class Tokenizer(Configurable):
    """A ``tokenizer.json`` (HF ``tokenizers`` format), or bytes when no path is given."""

    class Config(Configurable.Config):
        # tokenizer.json, or the directory holding it (a Hugging Face model directory); None:
        # the byte tokenizer (vocabulary 256).
        path: Optional[str] = None
        # Token that starts every document (None: the tokenizer's bos_token -- from
        # tokenizer_config.json, unless it says add_bos_token false -- or its one special
        # token; "": none).
        bos_token: Optional[str] = None
        # Token that ends every document (None: the tokenizer's eos_token, or its one special
        # token; "": none).
        eos_token: Optional[str] = None
        # A Jinja chat template for conversations, instead of the tokenizer's own (its
        # tokenizer_config.json's chat_template, or chat_template.jinja); with neither,
        # chat.DEFAULT_TEMPLATE ("role: content" lines).
        chat_template: Optional[str] = None

    def __init__(self, cfg=None, **fields):
        super().__init__(cfg, **fields)
        cfg = self.config
        self._bytes = cfg.path is None
        self._template: Optional[chat.ChatTemplate] = None
        self._shipped_template: Optional[str] = None
        if self._bytes:
            self._impl = ByteTokenizer()
            self.vocab_size = ByteTokenizer.vocab_size
            self.bos_id = self.eos_id = None
            return
        self.file = tokenizer_file(cfg.path, where="tokenizer.path")
        try:
            from tokenizers import Tokenizer as HFTokenizer  # pylint: disable=import-outside-toplevel
            self._impl = HFTokenizer.from_file(self.file)
        except Exception as e:  # pylint: disable=broad-except  (the package's own errors)
            raise errors.DataError(f"cannot load the tokenizer: {e}", path="tokenizer.path",
                                   suggestion=f"give a tokenizer.json written by the tokenizers "
                                              f"package ({self.file})") from e
        # A document's text is text: "<|endoftext|>" written in it is not the boundary token.
        # (A chat template's markup is read with its special tokens: ``_markup``.)
        self._markup = HFTokenizer.from_file(self.file)
        self._impl.encode_special_tokens = True
        self.vocab_size = self._impl.get_vocab_size(with_added_tokens=True)
        directory = os.path.dirname(self.file)
        tokenizer_config = _tokenizer_config(directory)
        self._shipped_template = chat.template_source(tokenizer_config, directory)
        special = _special_tokens(tokenizer_config, self._impl)
        self.bos_id = self._id(special.get("bos_token") if cfg.bos_token is None
                               else cfg.bos_token or None, "bos_token")
        self.eos_id = self._id(special.get("eos_token") if cfg.eos_token is None
                               else cfg.eos_token or None, "eos_token")
        if self.bos_id is None and self.eos_id is None:
            _log.warning("%s names no BOS or EOS token (no tokenizer_config.json, and not one "
                         "special token): documents get no boundary token; set "
                         "tokenizer.bos_token / eos_token", self.file)

    def _id(self, token: Optional[str], field: str) -> Optional[int]:
        if token is None:
            return None
        token_id = self._impl.token_to_id(token)
        if token_id is None:
            raise errors.DataError(f"{token!r} is not in the tokenizer's vocabulary",
                                   path=f"tokenizer.{field}",
                                   suggestion="name one of its special tokens (or leave it unset)")
        return token_id

    def encode(self, text: str) -> np.ndarray:
        """The ids of ``text`` (no BOS / EOS added: documents get those where they are cut)."""
        if self._bytes:
            return self._impl.encode(text)
        return np.asarray(self._impl.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        if self._bytes:
            return [self._impl.encode(t) for t in texts]
        return [np.asarray(e.ids, np.int32)
                for e in self._impl.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        if self._bytes:
            return self._impl.decode(ids)
        return self._impl.decode([int(i) for i in ids], skip_special_tokens=False)

    def token(self, token_id: Optional[int]) -> str:
        """The text of a special token (``""`` for None)."""
        return "" if token_id is None else self._impl.id_to_token(token_id)

    @property
    def chat_template(self) -> chat.ChatTemplate:
        """The template conversations are rendered with (see the config field)."""
        if self._template is None:
            source = (self.config.chat_template or self._shipped_template
                      or chat.DEFAULT_TEMPLATE)
            try:
                self._template = chat.ChatTemplate(source, bos_token=self.token(self.bos_id),
                                                   eos_token=self.token(self.eos_id))
            except Exception as e:  # pylint: disable=broad-except  (Jinja's syntax errors)
                raise errors.DataError(f"the chat template does not compile: {e}",
                                       path="tokenizer.chat_template",
                                       suggestion="fix the template") from e
        return self._template

    def encode_conversation(self, messages) -> "tuple[np.ndarray, np.ndarray]":
        """``(ids, trained)``: a conversation rendered by the chat template, its special tokens
        read as such, and per token whether it is the assistant's (trained on). Each span is
        encoded on its own, as a prompt and its completion are. A ``chat.TemplateError`` when the
        template cannot render it."""
        ids, trained = [], []
        for text, is_trained in self.chat_template.spans(messages):
            piece = (self._impl.encode(text) if self._bytes else np.asarray(
                self._markup.encode(text, add_special_tokens=False).ids, np.int32))
            ids.append(piece)
            trained.append(np.full(len(piece), is_trained))
        if not ids:
            return np.zeros(0, np.int32), np.zeros(0, bool)
        return np.concatenate(ids).astype(np.int32), np.concatenate(trained)


def tokenizer_file(path: str, *, where: str) -> str:
    """``path`` itself, or ``path/tokenizer.json``; a missing one is a ``DataError``."""
    candidate = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(candidate):
        raise errors.DataError(
            "no such file" if not os.path.isdir(path) else f"the directory has no {TOKENIZER_FILE}",
            path=f"{where}: {candidate}",
            suggestion="give a tokenizer.json (python -m titanax.data.train_tokenizer writes "
                       "one) or the Hugging Face model directory that holds it")
    return os.path.abspath(candidate)


def _tokenizer_config(directory: str) -> Optional[dict]:
    """The directory's tokenizer_config.json (None: there is none)."""
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    return read_json_object(path, error=errors.DataError, suggestion="fix or remove the file")


def _special_tokens(config: Optional[dict], tokenizer: Any) -> dict:
    """bos_token / eos_token from tokenizer_config.json (strings or {"content": ...} entries;
    ``add_bos_token: false`` drops the BOS), else the tokenizer's one special token as both when
    it is a boundary token (what train_tokenizer writes: <|endoftext|>; GPT-2's tokenizer.json)."""
    if config is None:
        specials = [t.content for t in tokenizer.get_added_tokens_decoder().values()
                    if t.special]
        if len(specials) == 1 and specials[0] in BOUNDARY_TOKENS:
            return {"bos_token": specials[0], "eos_token": specials[0]}
        return {}
    out = {}
    for key in ("bos_token", "eos_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    if config.get("add_bos_token") is False:
        out.pop("bos_token", None)
    return out
