"""Tokenizers: a SentencePiece model, or ids as they are (NullTokenizer)."""

from __future__ import annotations

import os
from typing import List

from megatron_ext.errors import UsageError


class SentencePieceTokenizer:
    """A SentencePiece model; the end-of-document id (EOD) is its end-of-sentence id.

    Exposes what megatron-core's datasets read from a tokenizer (``vocab_size``, ``eod``).
    """

    def __init__(self, model_path: str):
        import sentencepiece

        if not os.path.isfile(model_path):
            raise UsageError(f"--tokenizer-model {model_path}: file not found")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
        except (RuntimeError, OSError) as err:
            raise UsageError(f"--tokenizer-model {model_path}: not a SentencePiece model ({err})")
        self.model_path = model_path
        # megatron-core hashes this into the names of its dataset index caches.
        self.unique_identifiers = {"class": type(self).__name__,
                                   "tokenizer_path": [os.path.abspath(model_path)]}
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise UsageError(f"--tokenizer-model {model_path} has no end-of-sentence piece; "
                             "train it with tools/train_tokenizer.py (which adds </s>)")

    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text``."""
        return self._sp.encode(text)

    def detokenize(self, ids: List[int]) -> str:
        """Text of token ids."""
        return self._sp.decode(list(ids))


class NullTokenizer:
    """Ids used as they are; EOD is the id just past them (Megatron-LM's NullTokenizer)."""

    def __init__(self, vocab_size: int):
        self.eod = int(vocab_size)
        self.vocab_size = self.eod + 1
        self.unique_identifiers = {"class": type(self).__name__, "vocab_size": self.vocab_size}

    def tokenize(self, text: str) -> List[int]:
        """Whitespace-separated integers as ids."""
        return [int(x) for x in text.split()]

    def detokenize(self, ids: List[int]) -> str:
        """Ids as whitespace-separated integers."""
        return " ".join(str(i) for i in ids)


def build_tokenizer(data_cfg):
    """The tokenizer named by --tokenizer-type."""
    if data_cfg.tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        return SentencePieceTokenizer(data_cfg.tokenizer_model)
    return NullTokenizer(data_cfg.vocab_size)
