"""The three kinds of vocabulary a ``Tokenizer`` reads, behind one small interface.

- ``ByteTokenizer``: every UTF-8 byte is a token (vocabulary 256); no file.
- ``TokenizersFile``: a Hugging Face ``tokenizer.json`` (the ``tokenizers`` package).
- ``SentencePieceFile``: a SentencePiece ``.model`` (Llama 2, Mistral, Gemma ship one; the
  ``sentencepiece`` package, the ``sentencepiece`` extra).

Each encodes *text* -- a document's "<|endoftext|>" or "<s>" is text, not the boundary token --
and *markup* (a rendered chat template), where special tokens are read as such. Markup comes in
pieces (a conversation's turns, encoded one by one); ``start`` says whether a piece begins the
whole text, for SentencePiece's word-start mark, which only the text's start gets.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence, Set

import numpy as np

from titanax import errors

# Special tokens that mark a document boundary when a tokenizer.json has no other.
BOUNDARY_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


class ByteTokenizer:
    """Text <-> uint8 ids."""

    vocab_size = 256

    @staticmethod
    def encode(text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        return [self.encode(t) for t in texts]

    def encode_markup(self, text: str, *, start: bool = True) -> np.ndarray:
        del start
        return self.encode(text)

    @staticmethod
    def decode(ids) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")

    @staticmethod
    def token_to_id(token: str) -> Optional[int]:
        del token
        return None

    @staticmethod
    def id_to_token(token_id: int) -> str:
        del token_id
        return ""

    @staticmethod
    def default_specials() -> Dict[str, str]:
        return {}

    @staticmethod
    def special_ids() -> Set[int]:
        return set()


class TokenizersFile:
    """A ``tokenizer.json``."""

    def __init__(self, file: str):
        from tokenizers import Tokenizer as HFTokenizer  # pylint: disable=import-outside-toplevel
        try:
            self._text = HFTokenizer.from_file(file)
            self._markup = HFTokenizer.from_file(file)
        except Exception as e:  # pylint: disable=broad-except  (the package's own errors)
            raise errors.DataError(f"cannot load the tokenizer: {e}", path="tokenizer.path",
                                   suggestion=f"give a tokenizer.json written by the tokenizers "
                                              f"package ({file})") from e
        self._text.encode_special_tokens = True
        self.vocab_size = self._text.get_vocab_size(with_added_tokens=True)

    def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        return [np.asarray(e.ids, np.int32)
                for e in self._text.encode_batch(list(texts), add_special_tokens=False)]

    def encode_markup(self, text: str, *, start: bool = True) -> np.ndarray:
        """(A SentencePiece-style tokenizer.json marks each piece's start as a word start:
        the span boundaries of a conversation may then differ from transformers' by that.)"""
        del start
        return np.asarray(self._markup.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids) -> str:
        return self._text.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._text.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        return self._text.id_to_token(token_id)

    def special_ids(self) -> Set[int]:
        """The ids of its special added tokens (``<|im_end|>``, ``<s>``...)."""
        return {i for i, t in self._text.get_added_tokens_decoder().items() if t.special}

    def default_specials(self) -> Dict[str, str]:
        """Its one special token as BOS and EOS when that is a boundary token (what
        train_tokenizer writes: <|endoftext|>; GPT-2's tokenizer.json)."""
        specials = [t.content for t in self._text.get_added_tokens_decoder().values()
                    if t.special]
        if len(specials) == 1 and specials[0] in BOUNDARY_TOKENS:
            return {"bos_token": specials[0], "eos_token": specials[0]}
        return {}


class SentencePieceFile:
    """A SentencePiece ``.model``."""

    def __init__(self, file: str):
        try:
            import sentencepiece  # pylint: disable=import-outside-toplevel
        except ImportError as e:
            raise errors.DataError("reading a SentencePiece model needs sentencepiece",
                                   path="tokenizer.path",
                                   suggestion="pip install 'titanax[sentencepiece]'") from e
        try:
            self._model = sentencepiece.SentencePieceProcessor(model_file=file)
        except Exception as e:  # pylint: disable=broad-except  (the package's own errors)
            raise errors.DataError(f"cannot load the SentencePiece model: {e}",
                                   path="tokenizer.path",
                                   suggestion=f"give a .model written by sentencepiece "
                                              f"({file})") from e
        model = self._model
        self.vocab_size = model.get_piece_size()
        # Control and user-defined pieces: read as themselves in markup.
        self._special = {model.id_to_piece(i): i for i in range(self.vocab_size)
                         if model.is_control(i) or _is_user_defined(model, i)}
        self._split = (re.compile("(" + "|".join(re.escape(p) for p in sorted(
            self._special, key=len, reverse=True)) + ")") if self._special else None)

    def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        return [np.asarray(ids, np.int32) for ids in self._model.encode(list(texts))]

    def encode_markup(self, text: str, *, start: bool = True) -> np.ndarray:
        """Special pieces read as such; only text at the very start of the whole text gets
        the word-start mark (as transformers' SentencePiece tokenizers do: none after a special
        token, none at a later turn's start)."""
        parts = self._split.split(text) if self._split is not None else [text]
        ids: List[int] = []
        for index, part in enumerate(parts):
            if part in self._special:
                ids.append(self._special[part])
            elif part:
                ids.extend(self._model.encode(part) if start and index == 0
                           else self._continuation(part))
        return np.asarray(ids, np.int32)

    def _continuation(self, text: str) -> List[int]:
        """``text`` encoded as the continuation of other text (no word-start mark added):
        after a fixed lead whose pieces are dropped."""
        lead = self._model.encode(_LEAD)
        ids = self._model.encode(_LEAD + text)
        if ids[:len(lead)] != lead:  # The lead merged into the text: fall back, marked.
            return self._model.encode(text)
        return ids[len(lead):]

    def decode(self, ids) -> str:
        return self._model.decode([int(i) for i in ids])

    def token_to_id(self, token: str) -> Optional[int]:
        token_id = self._model.piece_to_id(token)
        return token_id if self._model.id_to_piece(token_id) == token else None

    def id_to_token(self, token_id: int) -> str:
        return self._model.id_to_piece(token_id)

    def special_ids(self) -> Set[int]:
        """The ids of its control and user-defined pieces."""
        return set(self._special.values())

    def default_specials(self) -> Dict[str, str]:
        """The model's own BOS / EOS pieces (-1: it has none)."""
        model, out = self._model, {}
        for key, token_id in (("bos_token", model.bos_id()), ("eos_token", model.eos_id())):
            if token_id >= 0:
                out[key] = model.id_to_piece(token_id)
        return out


# Text encoded before a continuation, then dropped (what transformers prepends: its unknown
# token, as text).
_LEAD = "<unk>"


def _is_user_defined(model, token_id: int) -> bool:
    check = getattr(model, "is_user_defined", None)
    return bool(check(token_id)) if check is not None else False
