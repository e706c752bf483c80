"""Tokenizers: bytes (the default for the bundled corpus), a Hugging Face ``tokenizer.json``, or a
SentencePiece ``.model``.

Bytes need no file: every UTF-8 byte is a token (vocabulary 256), so any text round-trips.
``Tokenizer`` (a config) loads a ``tokenizer.json`` -- written by ``python -m
titanax.data.train_tokenizer`` or shipped with a Hugging Face model -- through the ``tokenizers``
package, or a SentencePiece model through ``sentencepiece`` (``tokenizer_backends.py``), with the
BOS / EOS ids the model expects (from the directory's ``tokenizer_config.json``, else the
vocabulary's own). Its ``path`` left unset gives the byte tokenizer. Conversations are rendered
with the tokenizer's chat template (``chat.py``).
"""

from __future__ import annotations

import logging
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from titanax import errors
from titanax.config import Configurable
from titanax.data import bundled, chat
from titanax.data.tokenizer_backends import ByteTokenizer, SentencePieceFile, TokenizersFile
from titanax.io.files import read_json_object

TOKENIZER_FILE = "tokenizer.json"
# A SentencePiece model's name in a Hugging Face model directory.
SENTENCEPIECE_FILE = "tokenizer.model"

_log = logging.getLogger("titanax")


class Tokenizer(Configurable):
    """A ``tokenizer.json`` or SentencePiece model, or bytes when no path is given."""

    class Config(Configurable.Config):
        # tokenizer.json, a SentencePiece .model, or the directory holding one (a Hugging Face
        # model directory; tokenizer.json first); None: the byte tokenizer (vocabulary 256).
        path: Optional[str] = None
        # Token that starts every document (None: the tokenizer's bos_token -- from
        # tokenizer_config.json, unless it says add_bos_token false -- or its own; "": none).
        bos_token: Optional[str] = None
        # Token that ends every document (None: the tokenizer's eos_token, or its own; "":
        # none).
        eos_token: Optional[str] = None
        # A Jinja chat template for conversations, instead of the tokenizer's own (its
        # tokenizer_config.json's chat_template, or chat_template.jinja), or "plain" for
        # chat.DEFAULT_TEMPLATE ("### <role>" lines). Needed for conversations when the
        # tokenizer directory ships no template (bytes, path None, use "plain" unasked);
        # titanax.export writes it into the exported tokenizer_config.json.
        chat_template: Optional[str] = None

    def __init__(self, cfg=None, **fields):
        super().__init__(cfg, **fields)
        cfg = self.config
        self._template: Optional[chat.ChatTemplate] = None
        self._shipped_template: Optional[str] = None
        self.file: Optional[str] = None
        if cfg.path is None:
            self._impl = ByteTokenizer()
            self.vocab_size = ByteTokenizer.vocab_size
            self.bos_id = self.eos_id = None
            return
        self.file = tokenizer_file(cfg.path, where="tokenizer.path")
        self._impl = (SentencePieceFile(self.file) if not self.file.endswith(".json")
                      else TokenizersFile(self.file))
        self.vocab_size = self._impl.vocab_size
        directory = os.path.dirname(self.file)
        tokenizer_config = _tokenizer_config(directory)
        self._shipped_template = chat.template_source(tokenizer_config, directory)
        special = (self._impl.default_specials() if tokenizer_config is None
                   else _configured_specials(tokenizer_config))
        self.bos_id = self._id(special.get("bos_token") if cfg.bos_token is None
                               else cfg.bos_token or None, "bos_token")
        self.eos_id = self._id(special.get("eos_token") if cfg.eos_token is None
                               else cfg.eos_token or None, "eos_token")
        if self.bos_id is None and self.eos_id is None:
            _log.warning("%s names no BOS or EOS token (no tokenizer_config.json, and none of "
                         "its own): documents get no boundary token; set "
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
        return self._impl.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        return self._impl.encode_batch(texts)

    def decode(self, ids) -> str:
        return self._impl.decode(ids)

    def token(self, token_id: Optional[int]) -> str:
        """The text of a special token (``""`` for None)."""
        return "" if token_id is None else self._impl.id_to_token(token_id)

    @property
    def chat_template(self) -> chat.ChatTemplate:
        """The template conversations are rendered with (see the config field)."""
        if self._template is None:
            source = self.template_source()
            try:
                self._template = chat.ChatTemplate(source, bos_token=self.token(self.bos_id),
                                                   eos_token=self.token(self.eos_id))
            except Exception as e:  # pylint: disable=broad-except  (Jinja's syntax errors)
                raise errors.DataError(f"the chat template does not compile: {e}",
                                       path="tokenizer.chat_template",
                                       suggestion="fix the template") from e
        return self._template

    def template_source(self) -> str:
        """The Jinja source conversations are rendered with; a tokenizer directory that ships
        none, with no ``chat_template`` configured, is refused."""
        source = chat.named_template(self.config.chat_template) or self._shipped_template
        if source is None and self.config.path is None:
            source = chat.DEFAULT_TEMPLATE  # (Bytes: Titanax's own tokenizer, its own format.)
        if source is None:
            raise errors.MissingChatTemplateError(
                f"the tokenizer {self.file} ships no chat template (no chat_template in its "
                "tokenizer_config.json, no chat_template.jinja) to render conversations with",
                path="tokenizer.chat_template",
                suggestion=f"set tokenizer.chat_template to a Jinja template (or "
                           f"'{chat.PLAIN}' for '### <role>' lines; titanax.export writes it "
                           "into the model it exports), or use a chat model's tokenizer")
        return source

    def encode_markup(self, text: str, *, start: bool) -> List[int]:
        """The ids of rendered chat text, its special tokens read as such; ``start``: the
        text opens the whole sequence (a SentencePiece word-start mark goes there only)."""
        return [int(i) for i in self._impl.encode_markup(text, start=start)]

    def encode_prompt(self, text: str) -> List[int]:
        """A prompt as a model of this tokenizer reads it at inference: its special tokens read
        as such (as transformers' ``tokenizer(text)`` does), after BOS where documents start
        with one."""
        ids = [int(i) for i in self._impl.encode_markup(text, start=True)]
        if self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids

    def encode_chat_prompt(self, messages: Sequence[Tuple[str, str]]) -> List[int]:
        """``messages`` ((role, content), ...) rendered by the chat template with the generation
        prompt, special tokens read as such: the ids of transformers'
        ``apply_chat_template(messages, add_generation_prompt=True)``. A ``chat.TemplateError``
        when the template refuses them."""
        text = self.chat_template.render(messages, add_generation_prompt=True)
        return [int(i) for i in self._impl.encode_markup(text, start=True)]

    def chat_end_ids(self) -> List[int]:
        """The token that ends an assistant's turn in the chat template (``<|im_end|>``,
        ``<|eot_id|>``, ``</s>``...): the special token the template writes right after the
        turn's text; empty when it writes none there."""
        marker = "\ue002"
        try:
            text = self.chat_template.render([("user", "x"), ("assistant", marker)])
        except chat.TemplateError:
            return []
        suffix = text.split(marker, 1)[1] if marker in text else ""
        ids = [int(i) for i in self._impl.encode_markup(suffix, start=False)] if suffix else []
        return ids[:1] if ids and ids[0] in self._impl.special_ids() else []

    def encode_conversation(self, messages) -> Tuple[np.ndarray, np.ndarray]:
        """``(ids, trained)``: a conversation rendered by the chat template, its special tokens
        read as such, and per token whether it is the assistant's (trained on). Each span is
        encoded on its own, as a prompt and its completion are. A ``chat.TemplateError`` when the
        template cannot render it."""
        ids, trained = [], []
        for index, (text, is_trained) in enumerate(self.chat_template.spans(messages)):
            piece = self._impl.encode_markup(text, start=index == 0)
            ids.append(piece)
            trained.append(np.full(len(piece), is_trained))
        if not ids:
            return np.zeros(0, np.int32), np.zeros(0, bool)
        return np.concatenate(ids).astype(np.int32), np.concatenate(trained)


def tokenizer_file(path: str, *, where: str) -> str:
    """``path`` itself, or the directory's ``tokenizer.json`` (else its ``tokenizer.model``); a
    missing one is a ``DataError``. ``bundled:<name>`` is Titanax's own (data/bundled)."""
    path = bundled.resolve(path)
    candidate = path
    if os.path.isdir(path):
        candidate = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(candidate) and os.path.isfile(
                os.path.join(path, SENTENCEPIECE_FILE)):
            candidate = os.path.join(path, SENTENCEPIECE_FILE)
    if not os.path.isfile(candidate):
        raise errors.DataError(
            "no such file" if not os.path.isdir(path)
            else f"the directory has no {TOKENIZER_FILE} or {SENTENCEPIECE_FILE}",
            path=f"{where}: {candidate}",
            suggestion="give a tokenizer.json (python -m titanax.data.train_tokenizer writes "
                       "one), a SentencePiece .model, or the Hugging Face model directory that "
                       "holds one")
    return os.path.abspath(candidate)


def _tokenizer_config(directory: str) -> Optional[dict]:
    """The directory's tokenizer_config.json (None: there is none)."""
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    return read_json_object(path, error=errors.DataError, suggestion="fix or remove the file")


def _configured_specials(config: dict) -> dict:
    """bos_token / eos_token from tokenizer_config.json (strings or {"content": ...} entries;
    ``add_bos_token: false`` drops the BOS)."""
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


def vocabulary_difference(a: "Tokenizer", b: "Tokenizer") -> Optional[str]:
    """Where two tokenizers differ as a model sees them (the vocabulary size, an id's token, the
    end-of-sequence id), in words; None: the same ids mean the same tokens."""
    if a.vocab_size != b.vocab_size:
        return f"{a.vocab_size} tokens vs {b.vocab_size}"
    if a.eos_id != b.eos_id:
        return f"end-of-sequence id {a.eos_id} vs {b.eos_id}"
    for token_id in range(a.vocab_size):
        if a._impl.id_to_token(token_id) != b._impl.id_to_token(token_id):  # pylint: disable=protected-access
            return (f"id {token_id} is {a._impl.id_to_token(token_id)!r} vs "  # pylint: disable=protected-access
                    f"{b._impl.id_to_token(token_id)!r}")  # pylint: disable=protected-access
    return None

