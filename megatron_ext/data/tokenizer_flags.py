"""Which tokenizer flags each ``--tokenizer-type`` reads: Megatron-LM's rule, one table.

Megatron-LM (core_v0.16.1: ``megatron/training/tokenizer/tokenizer.py`` and megatron-core's
``tokenizers/text/utils/build_tokenizer.py``) builds a tokenizer from the flags its type
reads and ignores the others: ``--vocab-size`` is read by NullTokenizer and TikTokenizer
only, ``--tiktoken-pattern`` by TikTokenizer only, and so on. Its example scripts rely on
that (examples/llama gives ``--tiktoken-pattern v2`` with NullTokenizer, and
``--vocab-size`` with HuggingFaceTokenizer). The rule here is the same, for every flag of
:data:`READERS`: a flag the type does not read is ignored, and says so in one log line
(:func:`ignored_tokenizer_flags`); a flag the type needs and lacks is refused in one line
(:func:`check_tokenizer_flags`). A flag Megatron-LM's tokenizer of that type reads but this
project's does not implement is refused, never ignored.
"""

from __future__ import annotations

import os
from typing import List, Optional

from megatron_ext.errors import UsageError

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer", "NullTokenizer")
# Types that load --tokenizer-model, and the ones that load --vocab-file/--merge-file.
MODEL_FILE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                    "HuggingFaceTokenizer", "TikTokenizer")
BPE_FILE_TYPES = ("GPT2BPETokenizer",)
TIKTOKEN_PATTERN_NAMES = ("v1", "v2")

# Flag -> (its field, the types whose Megatron-LM tokenizer reads it, the types whose
# tokenizer here reads it). No type (None) is NullTokenizer here (a vocabulary from
# --vocab-size). A type of the second tuple that is not in the third is refused (Megatron-LM
# would use the flag, this project would not); one in neither ignores the flag.
_SPECIAL_READERS = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                    "Llama2Tokenizer", "HuggingFaceTokenizer", "TikTokenizer")
READERS = {
    "--tokenizer-model": ("tokenizer_model", MODEL_FILE_TYPES, MODEL_FILE_TYPES),
    # megatron-core hands them to transformers with HuggingFaceTokenizer.
    "--vocab-file": ("vocab_file", ("GPT2BPETokenizer", "HuggingFaceTokenizer"),
                     BPE_FILE_TYPES),
    "--merge-file": ("merge_file", ("GPT2BPETokenizer", "HuggingFaceTokenizer"),
                     BPE_FILE_TYPES),
    "--vocab-size": ("vocab_size", ("NullTokenizer", None, "TikTokenizer"),
                     ("NullTokenizer", None, "TikTokenizer")),
    "--tiktoken-pattern": ("tiktoken_pattern", ("TikTokenizer",), ("TikTokenizer",)),
    "--vocab-extra-ids": ("vocab_extra_ids", ("SentencePieceTokenizer",),
                          ("SentencePieceTokenizer",)),
    "--tokenizer-special-tokens": ("tokenizer_special_tokens", _SPECIAL_READERS,
                                   ("TikTokenizer",)),
    "--tiktoken-special-tokens": ("tiktoken_special_tokens", _SPECIAL_READERS,
                                  ("TikTokenizer",)),
    # megatron-core's GPT2BPETokenizer goes through transformers too.
    "--tokenizer-hf-include-special-tokens": ("tokenizer_hf_include_special_tokens",
                                              ("HuggingFaceTokenizer", "GPT2BPETokenizer"),
                                              ("HuggingFaceTokenizer",)),
}


def _given(args, field: str) -> bool:
    # Absent fields (a tool's namespace without the flag) and the defaults are not given.
    return getattr(args, field, None) not in (None, 0, False, "", [])


def ignored_tokenizer_flags(args) -> List[str]:
    """One log line per tokenizer flag given that ``args.tokenizer_type`` does not read.

    Args:
        args: The tokenizer fields of :class:`megatron_ext.config.data.DataConfig` (or a
            tool's namespace with the same names).
    """
    kind = args.tokenizer_type
    name = kind or "NullTokenizer"
    lines = []
    for flag, (field, megatron_readers, _) in READERS.items():
        if _given(args, field) and kind not in megatron_readers:
            value = getattr(args, field)
            shown = "" if value is True else " " + (" ".join(value) if isinstance(value, list)
                                                    else str(value))
            lines.append(f"{flag}{shown}: not read by --tokenizer-type {name}; ignored, as "
                         "Megatron-LM ignores it")
    return lines


def check_file(path: Optional[str], flag: str, tokenizer_type: str) -> str:
    """``path``, which ``tokenizer_type`` needs as ``flag``; a one-line error if missing."""
    if not path:
        raise UsageError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if not os.path.exists(path):
        what = ("no such tokenizer directory or tokenizer.json"
                if tokenizer_type == "HuggingFaceTokenizer" else "file not found")
        raise UsageError(f"{flag} {path}: {what}")
    return path


def check_tokenizer_flags(args) -> None:
    """One-line errors for tokenizer flags that ``--tokenizer-type`` needs or cannot honour.

    ``args`` has the tokenizer fields of :class:`megatron_ext.config.data.DataConfig`
    (pretrain_gpt.py's config, or tools/preprocess_data.py's namespace). Flags the type
    does not read pass (see :func:`ignored_tokenizer_flags`).
    """
    kind = args.tokenizer_type
    name = kind or "NullTokenizer"
    if kind in MODEL_FILE_TYPES:
        check_file(getattr(args, "tokenizer_model", None), "--tokenizer-model", kind)
    if kind in BPE_FILE_TYPES:
        check_file(getattr(args, "vocab_file", None), "--vocab-file", kind)
        check_file(getattr(args, "merge_file", None), "--merge-file", kind)
    if kind == "TikTokenizer" and getattr(args, "tiktoken_pattern", None) not in \
            TIKTOKEN_PATTERN_NAMES:
        raise UsageError("--tokenizer-type TikTokenizer needs --tiktoken-pattern v1 or v2")
    for flag, (field, megatron_readers, readers) in READERS.items():
        if _given(args, field) and kind in megatron_readers and kind not in readers:
            hint = (": give the tokenizer's directory (or tokenizer.json) as --tokenizer-model"
                    if field in ("vocab_file", "merge_file") else "")
            raise UsageError(f"{flag} with --tokenizer-type {name}: Megatron-LM's tokenizer "
                             f"reads it, this project's does not (read here by "
                             f"{', '.join(str(t) for t in readers if t)} only){hint}")


def special_tokens(args) -> Optional[List[str]]:
    """The special tokens given (``--tokenizer-special-tokens``, else the older spelling)."""
    # Megatron-LM: --tiktoken-special-tokens is the deprecated spelling, used when
    # --tokenizer-special-tokens is not given.
    return (getattr(args, "tokenizer_special_tokens", None)
            or getattr(args, "tiktoken_special_tokens", None))
