"""Tokenizers with Megatron-LM's names and behaviour (``--tokenizer-type``).

Each class gives what megatron-core's datasets and ``tools/preprocess_data.py`` read from a
tokenizer: ``vocab_size`` (the ids the model must embed, before padding), ``eod`` (the
end-of-document id ``--append-eod`` appends), ``tokenize`` / ``tokenize_batch`` /
``detokenize``, and ``unique_identifiers`` (megatron-core hashes it into the names of its
dataset index caches). The ids each type gives for a text are those of Megatron-LM's class
of the same name (megatron/training/tokenizer/tokenizer.py at core_v0.16.1):

========================== ===================================================================
GPT2BPETokenizer           byte-level BPE from ``--vocab-file`` (vocab.json) and
                           ``--merge-file`` (merges.txt), no special tokens in the text;
                           EOD ``<|endoftext|>``; vocabulary = the entries of vocab.json
SentencePieceTokenizer     the SentencePiece model plus Megatron-LM's special tokens
                           ``<CLS> <SEP> <EOD> <MASK>`` (and ``<PAD>`` / ``<BOS>`` / ``<EOS>``
                           when the model has none) appended past its pieces, and
                           ``--vocab-extra-ids`` ``<extra_id_N>``; the special tokens' text in a
                           document is encoded as their ids; EOD is ``<EOD>``
GPTSentencePieceTokenizer  the SentencePiece model as it is; EOD its ``</s>`` id
Llama2Tokenizer            as GPTSentencePieceTokenizer, but every text starts with the
                           model's ``<s>`` (bos) id; EOD its ``</s>`` id
HuggingFaceTokenizer       transformers' AutoTokenizer from a local directory (or a
                           tokenizer.json file), never the hub; ids as ``tokenizer(text)``
                           gives them (with the special tokens its post-processor adds);
                           vocabulary ``len(tokenizer)``; EOD its eos token
TikTokenizer               tiktoken over Megatron-LM's JSON vocabulary (a list of
                           ``{"rank", "token_bytes", "token_str"}``), ``--tiktoken-pattern``
                           v1/v2, ids shifted past ``--tiktoken-num-special-tokens`` special
                           tokens (``--tokenizer-special-tokens``, default ``<unk> <s> </s>``,
                           then ``<SPECIAL_N>`` fillers); ``--vocab-size`` is the whole
                           vocabulary (default 2**17); EOD ``</s>``
NullTokenizer              ids as they are (whitespace-separated integers); as Megatron-LM
                           at the installed megatron-core's tag: up to 0.17 EOD
                           ``--vocab-size``, vocabulary ``--vocab-size`` + 1; from 0.18
                           EOD ``--vocab-size`` - 1, vocabulary ``--vocab-size``
========================== ===================================================================

Everything here is local-file only: nothing is downloaded.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from typing import Dict, Iterable, List, Optional, Sequence

from megatron_ext.data.tokenizer_flags import (  # noqa: F401 (the names' old home)
    BPE_FILE_TYPES,
    MODEL_FILE_TYPES,
    TIKTOKEN_PATTERN_NAMES,
    TOKENIZER_TYPES,
    check_file,
    check_tokenizer_flags,
    ignored_tokenizer_flags,
    special_tokens,
)
from megatron_ext.errors import UsageError
from megatron_ext.runtime.mcore_compat import null_vocab_includes_eod

log = logging.getLogger("megatron_ext")

# The pre-tokenization patterns of Megatron-LM's TikTokenizer (--tiktoken-pattern v1 / v2).
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
TIKTOKEN_REQUIRED_SPECIALS = ("<unk>", "<s>", "</s>")
TIKTOKEN_DEFAULT_VOCAB_SIZE = 2**17


class _Tokenizer:
    """What every tokenizer has; subclasses set ``vocab_size``, ``eod`` and ``tokenize``."""

    vocab_size: int
    eod: Optional[int]

    def __init__(self, **identifiers):
        self.unique_identifiers = {"class": type(self).__name__, **identifiers}

    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text``."""
        raise NotImplementedError

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of each text (subclasses batch where their library does it faster)."""
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of token ids."""
        raise NotImplementedError


class GPT2BPETokenizer(_Tokenizer):
    """GPT-2's byte-level BPE (HF ``tokenizers``), from vocab.json and merges.txt.

    As Megatron-LM's: GPT-2's pre-tokenization regex, no prefix space, no special-token
    parsing (``<|endoftext|>`` inside a text is encoded as its characters), undecodable
    bytes replaced on decode; EOD is the id of ``<|endoftext|>`` in vocab.json.
    """

    def __init__(self, vocab_file: str, merge_file: str):
        super().__init__(vocab_file=os.path.abspath(vocab_file),
                         merge_file=os.path.abspath(merge_file))
        from tokenizers import ByteLevelBPETokenizer

        try:
            with open(vocab_file, encoding="utf-8") as f:
                vocab = json.load(f)
            self._tok = ByteLevelBPETokenizer(vocab_file, merge_file, add_prefix_space=False)
        except (OSError, ValueError, Exception) as err:  # tokenizers raises plain Exception
            raise UsageError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: not a "
                             f"GPT-2 BPE vocabulary and merges file ({err})") from None
        self.vocab_size = len(vocab)
        if "<|endoftext|>" not in vocab:
            raise UsageError(f"--vocab-file {vocab_file} has no <|endoftext|> entry "
                             "(GPT2BPETokenizer's end-of-document token)")
        self.eod = vocab["<|endoftext|>"]

    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text``."""
        return self._tok.encode(text).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of each text."""
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of token ids."""
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _load_sentencepiece(model_path: str, flag: str = "--tokenizer-model"):
    import sentencepiece

    if not os.path.isfile(model_path):
        what = ("a directory, not a SentencePiece .model file" if os.path.isdir(model_path)
                else "file not found")
        raise UsageError(f"{flag} {model_path}: {what}")
    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_path, num_threads=1)
    except (RuntimeError, OSError) as err:
        raise UsageError(f"{flag} {model_path}: not a SentencePiece model ({err})") from None


def _piece_or(sp, piece_id: int, fallback: str) -> str:
    """The piece of ``piece_id``, or ``fallback`` when the model has none (id -1)."""
    if 0 <= piece_id < sp.get_piece_size():
        return sp.id_to_piece(piece_id)
    return fallback


def sentencepiece_special_tokens(pieces: Sequence[str], pad: str, bos: str, eos: str,
                                 vocab_extra_ids: int = 0) -> Dict[str, int]:
    """Megatron-LM's SentencePieceTokenizer special tokens and their ids, in its order.

    ``<CLS> <SEP> <EOD> <MASK>``, the pad, bos and eos pieces, then ``<extra_id_N>``; a
    token the model already has keeps its id, the others get the next ids past it.

    Args:
        pieces: the model's pieces by id.
        pad: the model's pad piece, or ``<PAD>`` when it has none.
        bos: the model's bos piece, or ``<BOS>``.
        eos: the model's eos piece, or ``<EOS>``.
        vocab_extra_ids: how many ``<extra_id_N>`` to add (``--vocab-extra-ids``).
    """
    vocab = {p: i for i, p in enumerate(pieces)}
    size = len(pieces)
    special: Dict[str, int] = {}
    names = ["<CLS>", "<SEP>", "<EOD>", "<MASK>", pad, bos, eos]
    names += [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
    for name in names:
        if name not in vocab:
            vocab[name] = size
            size += 1
        special[name] = vocab[name]
    return special


def split_at_special_tokens(text: str, special: Dict[str, int]):
    """Cuts ``text`` at the special tokens' strings, as Megatron-LM's SentencePieceTokenizer.

    Leftmost first; on a tie, the token first in ``special``'s order.

    Yields:
        ``(plain text, None)`` and ``(token string, id)`` pieces in order.
    """
    start = 0
    while True:
        best, best_at = None, -1
        for token in special:
            at = text.find(token, start)
            if at >= 0 and (best is None or at < best_at):
                best, best_at = token, at
        if best is None:
            break
        yield text[start:best_at], None
        yield best, special[best]
        start = best_at + len(best)
    yield text[start:], None


class SentencePieceTokenizer(_Tokenizer):
    """Megatron-LM's SentencePieceTokenizer: the model plus its special tokens.

    The vocabulary is the model's pieces plus the special tokens it lacks (see
    :func:`sentencepiece_special_tokens`), so ``vocab_size`` is larger than the model's
    and EOD is ``<EOD>``, an id past the model's pieces (unless the model has that piece).
    Text is cut at the special tokens' strings, each of which becomes its id; detokenizing
    puts the special tokens back with a space on either side (Megatron-LM's output).
    """

    def __init__(self, model_path: str, vocab_extra_ids: int = 0):
        super().__init__(tokenizer_path=[os.path.abspath(model_path)],
                         vocab_extra_ids=vocab_extra_ids)
        self._sp = sp = _load_sentencepiece(model_path)
        self.model_path = model_path
        pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
        self._special = sentencepiece_special_tokens(
            pieces, _piece_or(sp, sp.pad_id(), "<PAD>"), _piece_or(sp, sp.bos_id(), "<BOS>"),
            _piece_or(sp, sp.eos_id(), "<EOS>"), vocab_extra_ids)
        self._inv_special = {i: t for t, i in self._special.items()}
        self.vocab_size = max(len(pieces), max(self._special.values()) + 1)
        self.eod = self._special["<EOD>"]
        self.bos = self._special[_piece_or(sp, sp.bos_id(), "<BOS>")]
        self.eos = self._special[_piece_or(sp, sp.eos_id(), "<EOS>")]

    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text``."""
        ids: List[int] = []
        for piece, special_id in split_at_special_tokens(text, self._special):
            if special_id is None:
                ids.extend(self._sp.encode(piece))
            else:
                ids.append(special_id)
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of token ids."""
        ids = list(ids)
        text, last = "", 0
        for i, token_id in enumerate(ids):
            if token_id in self._inv_special:
                text += self._sp.decode(ids[last:i]) + " " + self._inv_special[token_id] + " "
                last = i + 1
        return text + self._sp.decode(ids[last:])


class GPTSentencePieceTokenizer(_Tokenizer):
    """The SentencePiece model as it is; EOD is its end-of-sentence (``</s>``) id."""

    def __init__(self, model_path: str):
        super().__init__(tokenizer_path=[os.path.abspath(model_path)])
        self._sp = _load_sentencepiece(model_path)
        self.model_path = model_path
        self.vocab_size = self._sp.get_piece_size()
        self.bos = self._sp.bos_id()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise UsageError(f"--tokenizer-model {model_path} has no end-of-sentence piece; "
                             "train it with tools/train_tokenizer.py (which adds </s>)")

    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text``."""
        return self._sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of each text."""
        return self._sp.encode(list(texts))

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of token ids."""
        return self._sp.decode(list(ids))


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Llama 2's use of a SentencePiece model: the bos id (``<s>``) starts every text.

    As Megatron-LM's (text completion: bos added, eos not); EOD is the eos id.
    """

    def __init__(self, model_path: str):
        super().__init__(model_path)
        if self.bos < 0:
            raise UsageError(f"--tokenizer-model {model_path} has no beginning-of-sentence "
                             "piece (<s>), which Llama2Tokenizer puts before every text")

    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text``."""
        return [self.bos] + self._sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of each text."""
        return [[self.bos] + ids for ids in self._sp.encode(list(texts))]


class HuggingFaceTokenizer(_Tokenizer):
    """transformers' AutoTokenizer from local files only (the hub is never asked).

    ``path`` is a directory (tokenizer.json or a slow tokenizer's files, with
    tokenizer_config.json naming the special tokens) or a tokenizer.json file. Ids are
    ``tokenizer(text).input_ids``, so they include the special tokens the tokenizer's
    post-processor adds (e.g. a bos id), as in Megatron-LM.
    """

    def __init__(self, path: str, add_special_tokens: bool = True):
        super().__init__(tokenizer_path=[os.path.abspath(path)])
        # False: the ids of the text alone (megatron-core's tokenizer in Megatron-LM's
        # preprocess_data.py without --tokenizer-hf-include-special-tokens).
        self.add_special_tokens = add_special_tokens
        if not os.path.exists(path):
            raise UsageError(f"--tokenizer-model {path}: no such directory or tokenizer.json "
                             "(HuggingFaceTokenizer loads local files only, never the hub)")
        # Before transformers is imported: it reads the variable at import.
        os.environ["HF_HUB_OFFLINE"] = "1"
        import transformers

        try:
            if os.path.isdir(path):
                self._tok = transformers.AutoTokenizer.from_pretrained(path,
                                                                       local_files_only=True)
            else:
                self._tok = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
        except (OSError, ValueError, TypeError) as err:
            msg = " ".join(str(err).split())[:300]
            raise UsageError(f"--tokenizer-model {path}: not a Hugging Face tokenizer ({msg})"
                             ) from None
        self.vocab_size = len(self._tok)
        self.eod = self._tok.eos_token_id
        self.bos = self._tok.bos_token_id

    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text``."""
        return list(self._tok(text, add_special_tokens=self.add_special_tokens).input_ids)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of each text."""
        if not texts:
            return []
        return [list(ids) for ids in self._tok(
            list(texts), add_special_tokens=self.add_special_tokens).input_ids]

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of token ids."""
        return self._tok.decode(list(ids))


def load_tiktoken_vocab(path: str, max_vocab: Optional[int] = None) -> Dict[bytes, int]:
    """Megatron-LM's TikTokenizer vocabulary: token bytes -> rank.

    The file is a JSON list whose i-th entry is ``{"rank": i, "token_bytes": base64,
    "token_str": text}``, the first 256 being the single bytes 0..255.

    Raises:
        UsageError: the file is not in that format.
    """
    where = f"--tokenizer-model {path}"
    if not path.endswith(".json"):
        raise UsageError(f"{where}: TikTokenizer reads a .json vocabulary (a list of "
                         '{"rank", "token_bytes", "token_str"}, as Megatron-LM does)')
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, ValueError) as err:
        raise UsageError(f"{where}: not a JSON file ({err})") from None
    if not isinstance(entries, list):
        raise UsageError(f"{where}: expected a JSON list of vocabulary entries")
    if max_vocab is not None:
        entries = entries[:max_vocab]
    ranks: Dict[bytes, int] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"} \
                or entry["rank"] != i:
            raise UsageError(f"{where}: entry {i} is not "
                             f'{{"rank": {i}, "token_bytes": ..., "token_str": ...}}')
        token = base64.b64decode(entry["token_bytes"])
        if i < 256 and token != bytes([i]):
            raise UsageError(f"{where}: entry {i} must be the single byte {i}")
        if token in ranks:
            raise UsageError(f"{where}: entry {i} repeats the bytes of entry {ranks[token]}")
        ranks[token] = i
    return ranks


def tiktoken_special_tokens(num_special_tokens: int, vocab_size: int,
                            special_tokens: Optional[Sequence[str]] = None) -> List[str]:
    """The special tokens of ids 0..num_special_tokens-1 (Megatron-LM's rule).

    The given tokens (default ``<unk> <s> </s>``, which they must include), then fillers
    ``<SPECIAL_N>`` up to ``num_special_tokens``.
    """
    tokens = list(special_tokens) if special_tokens else list(TIKTOKEN_REQUIRED_SPECIALS)
    if len(set(tokens)) != len(tokens):
        raise UsageError(f"--tokenizer-special-tokens {' '.join(tokens)}: a token is repeated")
    missing = [t for t in TIKTOKEN_REQUIRED_SPECIALS if t not in tokens]
    if missing:
        raise UsageError(f"--tokenizer-special-tokens must include {' '.join(missing)} "
                         "(TikTokenizer's unk, bos and eos)")
    if not len(tokens) <= num_special_tokens < vocab_size:
        raise UsageError(f"--tiktoken-num-special-tokens {num_special_tokens} must be at least "
                         f"the {len(tokens)} special tokens and below --vocab-size {vocab_size}")
    fillers = [f"<SPECIAL_{i}>" for i in range(len(tokens), num_special_tokens)]
    if set(fillers) & set(tokens):
        raise UsageError("--tokenizer-special-tokens: <SPECIAL_N> names are the fillers'")
    return tokens + fillers


class TikTokenizer(_Tokenizer):
    """Megatron-LM's TikTokenizer: tiktoken BPE with special tokens in the lowest ids.

    Ids 0..``num_special_tokens``-1 are the special tokens; the vocabulary file's ranks
    follow, shifted by ``num_special_tokens`` and cut so that the whole vocabulary is
    ``vocab_size``. Text is encoded without special-token parsing; EOD is ``</s>``.
    """

    def __init__(self, path: str, pattern: str, vocab_size: Optional[int],
                 num_special_tokens: int, special_tokens: Optional[Sequence[str]]):
        vocab_size = vocab_size or TIKTOKEN_DEFAULT_VOCAB_SIZE
        super().__init__(tokenizer_path=[os.path.abspath(path)], pattern=pattern,
                         vocab_size=vocab_size, num_special_tokens=num_special_tokens,
                         special_tokens=list(special_tokens or []))
        import tiktoken

        if pattern not in TIKTOKEN_PATTERNS:
            raise UsageError("--tokenizer-type TikTokenizer needs --tiktoken-pattern v1 or v2")
        specials = tiktoken_special_tokens(num_special_tokens, vocab_size, special_tokens)
        inner = vocab_size - num_special_tokens
        ranks = load_tiktoken_vocab(path, max_vocab=inner)
        if len(ranks) < inner:
            raise UsageError(
                f"--tokenizer-model {path} has {len(ranks)} entries, fewer than --vocab-size "
                f"{vocab_size} - --tiktoken-num-special-tokens {num_special_tokens} = {inner}; "
                f"give --vocab-size {len(ranks) + num_special_tokens}")
        shifted = {token: rank + num_special_tokens for token, rank in ranks.items()}
        special_ids = {t: i for i, t in enumerate(specials)}
        self._enc = tiktoken.Encoding(name=os.path.basename(os.path.dirname(os.path.abspath(
            path))) or "tiktoken", pat_str=TIKTOKEN_PATTERNS[pattern],
            mergeable_ranks=shifted, special_tokens=special_ids)
        self.vocab_size = vocab_size
        self.bos = special_ids["<s>"]
        self.eod = special_ids["</s>"]

    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text``."""
        return self._enc.encode_ordinary(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of token ids."""
        return self._enc.decode(list(ids))


class NullTokenizer(_Tokenizer):
    """Ids used as they are (Megatron-LM's NullTokenizer).

    Args:
        vocab_size: ``--vocab-size``.
        includes_eod: whether it counts the end-of-document id (Megatron-LM from
            core_v0.18.0: EOD ``vocab_size - 1``); otherwise EOD is the id just past them
            (up to core_v0.17: ``vocab_size + 1`` ids). By default as the installed
            megatron-core's Megatron-LM (:func:`~megatron_ext.runtime.mcore_compat.
            null_vocab_includes_eod`).
    """

    def __init__(self, vocab_size: int, includes_eod: Optional[bool] = None):
        if includes_eod is None:
            includes_eod = null_vocab_includes_eod()
        self.vocab_size = int(vocab_size) + (0 if includes_eod else 1)
        self.eod = self.vocab_size - 1
        super().__init__(vocab_size=self.vocab_size)

    def tokenize(self, text: str) -> List[int]:
        """Whitespace-separated integers as ids.

        Raises:
            ValueError: a word that is not an integer (the message names it).
        """
        ids = []
        for word in text.split():
            try:
                ids.append(int(word))
            except ValueError:
                raise ValueError(f"{word[:40]!r} is not a token id: NullTokenizer reads text "
                                 "as space-separated token ids") from None
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        """Ids as whitespace-separated integers."""
        return " ".join(str(i) for i in ids)


def build_tokenizer(args):
    """The tokenizer named by ``args.tokenizer_type`` (see the module's table).

    Args:
        args: the run's :class:`DataConfig` or a namespace with the same field names.
    """
    kind = args.tokenizer_type
    check_tokenizer_flags(args)
    for line in ignored_tokenizer_flags(args):
        log.info(line)
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(args.vocab_file, args.merge_file)
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(args.tokenizer_model, getattr(args, "vocab_extra_ids", 0))
    if kind == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(args.tokenizer_model)
    if kind == "Llama2Tokenizer":
        return Llama2Tokenizer(args.tokenizer_model)
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(args.tokenizer_model)
    if kind == "TikTokenizer":
        return TikTokenizer(args.tokenizer_model, args.tiktoken_pattern, args.vocab_size,
                            getattr(args, "tiktoken_num_special_tokens", 1000),
                            special_tokens(args))
    if kind in (None, "NullTokenizer"):
        if args.vocab_size is None:
            raise UsageError("no vocabulary: give --tokenizer-type and its files, or "
                             "--vocab-size N")
        return NullTokenizer(args.vocab_size)
    raise UsageError(f"--tokenizer-type {kind}: not one of {', '.join(TOKENIZER_TYPES)}")


# The types whose ids Megatron-LM's tools/preprocess_data.py (megatron-core's tokenizers,
# megatron/core/tokenizers, its default) and its training (megatron/training/tokenizer, as
# build_tokenizer here) give differently.
PREPROCESSING_DIFFERS = ("SentencePieceTokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer")


def preprocesses_with_core_tokenizer(args) -> bool:
    """Whether preprocessing ``args`` uses a tokenizer with other ids than training's.

    True for a type of :data:`PREPROCESSING_DIFFERS` without ``--legacy-tokenizer``: there
    Megatron-LM's ``tools/preprocess_data.py`` uses megatron-core's tokenizer.
    """
    return (not getattr(args, "legacy_tokenizer", False)
            and args.tokenizer_type in PREPROCESSING_DIFFERS)


def build_preprocessing_tokenizer(args):
    """The tokenizer of Megatron-LM's ``tools/preprocess_data.py`` for ``args``.

    Megatron-LM (core_v0.16.1) preprocesses with megatron-core's tokenizers unless
    ``--legacy-tokenizer``, and trains with megatron/training's (:func:`build_tokenizer`
    here). They give the same ids except for: SentencePieceTokenizer (megatron-core's: the
    model's pieces alone, EOD its ``</s>``; training's: Megatron-LM's special tokens added,
    EOD ``<EOD>``), Llama2Tokenizer (megatron-core's: no ``<s>`` before a text) and
    HuggingFaceTokenizer (megatron-core's: without the special tokens the post-processor
    adds, unless ``--tokenizer-hf-include-special-tokens``). For those three, without
    ``args.legacy_tokenizer``, this returns the megatron-core view; else
    :func:`build_tokenizer`'s.
    """
    kind = args.tokenizer_type
    if not preprocesses_with_core_tokenizer(args):
        return build_tokenizer(args)
    check_tokenizer_flags(args)
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(args.tokenizer_model, add_special_tokens=bool(
            getattr(args, "tokenizer_hf_include_special_tokens", False)))
    if getattr(args, "vocab_extra_ids", 0):
        raise UsageError("--vocab-extra-ids needs --legacy-tokenizer: by default "
                         "SentencePieceTokenizer is megatron-core's here, as in Megatron-LM's "
                         "preprocess_data.py, the model's pieces alone (Megatron-LM's tool "
                         "also sets vocab_extra_ids to 0 whatever is given)")
    return GPTSentencePieceTokenizer(args.tokenizer_model)
