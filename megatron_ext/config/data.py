"""The data config: corpora, splits, tokenizer, loader (Megatron-LM's data flags).

The conventions of every section are in :mod:`megatron_ext.config`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import List, Optional

from megatron_ext.config.checks import output_path, positive
from megatron_ext.errors import UsageError
from megatron_ext.runtime.fields import option


@dataclasses.dataclass
class DataConfig:
    """Corpus, split and tokenizer."""

    data_path: List[str] = option(default_factory=list, nargs="+", metavar="[WEIGHT] PREFIX")
    """One or more dataset prefixes (PREFIX.bin / PREFIX.idx from tools/preprocess_data.py),
    each optionally preceded by its sampling weight: '0.7 a_text_document 0.3 b_text_document'."""
    split: str = "969,30,1"
    """Proportions of train, validation and test documents: up to three numbers, read as
    megatron-core reads them (the numbers in the text: 99,1,0 or 99/1/0, and '99,1,0' with
    the quotes a launch script may pass through); a missing part is 0."""
    mock_data: bool = False
    """Train on megatron-core's synthetic MockGPTDataset instead of --data-path (smoke runs;
    the vocabulary comes from --vocab-size or the tokenizer)."""
    tokenizer_type: Optional[str] = option(
        None, choices=("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                       "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
                       "NullTokenizer"))
    """Tokenizer, as Megatron-LM's class of that name: GPT2BPETokenizer (--vocab-file,
    --merge-file; EOD <|endoftext|>), SentencePieceTokenizer (--tokenizer-model plus
    Megatron-LM's special tokens <CLS> <SEP> <EOD> <MASK> past its pieces; EOD <EOD>),
    GPTSentencePieceTokenizer (the model as it is; EOD </s>), Llama2Tokenizer (<s> before
    every text; EOD </s>), HuggingFaceTokenizer (--tokenizer-model a local directory or
    tokenizer.json; EOD its eos token), TikTokenizer (--tokenizer-model a tiktoken JSON
    vocabulary, --tiktoken-pattern; EOD </s>), or NullTokenizer (ids as they are,
    --vocab-size). Not given: GPT2BPETokenizer when --vocab-file or --merge-file is given
    (Megatron-LM's pretrain_gpt.py default), else NullTokenizer with --vocab-size. A
    tokenizer flag the type does not read (--vocab-size, --tokenizer-model, --vocab-file,
    --merge-file, --tiktoken-pattern, --vocab-extra-ids) is ignored, as Megatron-LM ignores
    it, with one log line."""
    tokenizer_model: Optional[str] = None
    """The tokenizer's file: a SentencePiece .model (SentencePieceTokenizer,
    GPTSentencePieceTokenizer, Llama2Tokenizer), a Hugging Face tokenizer directory or
    tokenizer.json (HuggingFaceTokenizer; local files only), or Megatron-LM's tiktoken
    JSON vocabulary (TikTokenizer)."""
    vocab_size: Optional[int] = None
    """Vocabulary size for NullTokenizer and --mock-data without a tokenizer (as Megatron-LM
    at the installed megatron-core's tag: with 0.16.1/0.17 V ids plus the end-of-document id
    V; from 0.18, e.g. 0.19.2, V ids with end-of-document V-1); with TikTokenizer the whole
    vocabulary, special tokens included (default 131072)."""
    vocab_file: Optional[str] = None
    """GPT2BPETokenizer's vocabulary (GPT-2's vocab.json)."""
    merge_file: Optional[str] = None
    """GPT2BPETokenizer's BPE merges (GPT-2's merges.txt)."""
    vocab_extra_ids: int = 0
    """SentencePieceTokenizer: add this many <extra_id_N> special tokens (T5 sentinels)."""
    tiktoken_pattern: Optional[str] = option(None, choices=("v1", "v2"))
    """TikTokenizer's pre-tokenization regex: Megatron-LM's v1 or v2 pattern."""
    tiktoken_num_special_tokens: int = 1000
    """TikTokenizer: ids 0..N-1 are special tokens (the given ones, then <SPECIAL_i>
    fillers); the vocabulary file's tokens follow."""
    tokenizer_special_tokens: Optional[List[str]] = option(None, nargs="+", metavar="TOKEN")
    """TikTokenizer's special tokens, in id order; must include <unk> <s> </s> (the
    default is just those three)."""
    tiktoken_special_tokens: Optional[List[str]] = option(None, nargs="+", metavar="TOKEN")
    """Megatron-LM's older spelling of --tokenizer-special-tokens (used when that is not
    given)."""
    eod_mask_loss: bool = False
    """Do not compute the loss on end-of-document tokens."""
    num_workers: int = 2
    """DataLoader worker processes per rank."""
    mmap_bin_files: bool = option(True, negate="--no-mmap-bin-files")
    """Read the PREFIX.bin files with plain reads instead of memory-mapping them."""
    create_attention_mask_in_dataloader: bool = option(
        True, negate="--no-create-attention-mask-in-dataloader")
    """Accepted for Megatron-LM scripts: the data loader never builds the dense attention
    mask here (attention is causal by construction in every backend), so the flag only
    confirms what happens anyway."""
    data_cache_path: Optional[str] = None
    """Directory for megatron-core's dataset index caches (default: megatron-core's
    choice, a folder PREFIX/cache beside each data prefix)."""

    def __post_init__(self):
        if self.tokenizer_type is None and (self.vocab_file or self.merge_file):
            # Megatron-LM's pretrain_gpt.py: args_defaults={'tokenizer_type': 'GPT2BPETokenizer'}.
            self.tokenizer_type = "GPT2BPETokenizer"
        split_shares(self.split)
        positive(self, "vocab_size", "tiktoken_num_special_tokens")
        if self.vocab_extra_ids < 0:
            raise UsageError("--vocab-extra-ids must be >= 0")
        if self.num_workers < 0:
            raise UsageError("--num-workers must be >= 0")
        output_path("--data-cache-path", self.data_cache_path)


# Characters megatron-core's split parser skips without changing the meaning: separators,
# spaces, and the quotes a launch script passes through ("--split '99,1,0'" inside a
# double-quoted bash array element reaches the program with its single quotes).
_SPLIT_SKIPPED = re.compile(r"[\s,/'\"]")


def split_shares(split: str) -> List[float]:
    """The train, validation and test proportions of ``--split``, as megatron-core reads them.

    megatron-core's ``parse_and_normalize_split`` takes the numbers it finds in the text
    (``re.findall(r"[.0-9]+", split)``) and pads them to three with zeros. The same here,
    except that text it would misread is refused: any character but digits, '.',
    separators and quotes (a minus sign would be dropped: "-1,1,0" read as 1,1,0).

    Returns:
        The three proportions, not normalized.

    Raises:
        UsageError: not up to three non-negative numbers, or all of them zero.
    """
    example = "give up to three non-negative numbers such as 969,30,1"
    stray = sorted(set(_SPLIT_SKIPPED.sub("", re.sub(r"[.0-9]+", "", split))))
    if stray:
        raise UsageError(f"--split {split!r}: {''.join(stray)!r} is not part of a split "
                         f"(megatron-core would skip it); {example}")
    try:
        shares = [float(x) for x in re.findall(r"[.0-9]+", split)]
    except ValueError:
        raise UsageError(f"--split {split!r}: not a list of numbers; {example}") from None
    if not shares or len(shares) > 3 or sum(shares) <= 0:
        raise UsageError(f"--split {split!r}: {example} (not all zero)")
    return shares + [0.0] * (3 - len(shares))
