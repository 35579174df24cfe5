"""megatron_ext/data/tokenizer_flags.py: a flag the tokenizer type does not read is ignored
with one log line (Megatron-LM's rule); one it needs and lacks, or one Megatron-LM's
tokenizer reads and this project's does not, is refused."""

from __future__ import annotations

import argparse
import logging

import pytest
import tokenizer_files as tf

from megatron_ext.data import tokenizer as tk
from megatron_ext.data import tokenizer_flags as flags
from megatron_ext.errors import UsageError

IGNORED = "not read by --tokenizer-type {}; ignored, as Megatron-LM ignores it"


def _args(**kw):
    base = dict(tokenizer_type=None, tokenizer_model=None, vocab_file=None, merge_file=None,
                vocab_size=None, vocab_extra_ids=0, tiktoken_pattern=None,
                tiktoken_num_special_tokens=1000, tokenizer_special_tokens=None,
                tiktoken_special_tokens=None)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return tf.make_hf_dir(str(tmp_path_factory.mktemp("hf") / "hf"))


@pytest.mark.parametrize("kw, lines", [
    # examples/llama's mock branch: NullTokenizer with --tiktoken-pattern v2.
    (dict(tokenizer_type="NullTokenizer", vocab_size=128, tiktoken_pattern="v2"),
     ["--tiktoken-pattern v2: " + IGNORED.format("NullTokenizer")]),
    # No type is NullTokenizer here; Megatron-LM's NullTokenizer reads neither file.
    (dict(vocab_size=128, tokenizer_model="x.model", vocab_file="v.json"),
     ["--tokenizer-model x.model: " + IGNORED.format("NullTokenizer"),
      "--vocab-file v.json: " + IGNORED.format("NullTokenizer")]),
    (dict(tokenizer_type="NullTokenizer", vocab_size=128, vocab_extra_ids=3,
          tokenizer_special_tokens=["<a>", "<b>"]),
     ["--vocab-extra-ids 3: " + IGNORED.format("NullTokenizer"),
      "--tokenizer-special-tokens <a> <b>: " + IGNORED.format("NullTokenizer")]),
    (dict(tokenizer_type="NullTokenizer", vocab_size=128), []),
])
def test_ignored_flags_are_named_one_line_each(kw, lines):
    args = _args(**kw)
    flags.check_tokenizer_flags(args)  # accepted
    assert flags.ignored_tokenizer_flags(args) == lines


def test_vocab_size_and_tiktoken_pattern_follow_the_same_rule(hf):
    # examples/llama's real-data branch gives --vocab-size with HuggingFaceTokenizer; the
    # mock branch --tiktoken-pattern with NullTokenizer: both ignored, both said.
    args = _args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=hf, vocab_size=128256,
                 tiktoken_pattern="v2")
    flags.check_tokenizer_flags(args)
    assert flags.ignored_tokenizer_flags(args) == [
        "--vocab-size 128256: " + IGNORED.format("HuggingFaceTokenizer"),
        "--tiktoken-pattern v2: " + IGNORED.format("HuggingFaceTokenizer")]


def test_build_tokenizer_logs_the_ignored_flags(hf, caplog):
    with caplog.at_level(logging.INFO, logger="megatron_ext"):
        tok = tk.build_tokenizer(_args(tokenizer_type="HuggingFaceTokenizer",
                                       tokenizer_model=hf, vocab_size=7))
    assert tok.vocab_size > 7  # the tokenizer's own vocabulary, as Megatron-LM
    assert caplog.messages == ["--vocab-size 7: " + IGNORED.format("HuggingFaceTokenizer")]


@pytest.mark.parametrize("kw, message", [
    (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="{hf}", merge_file="m.txt"),
     "--merge-file with --tokenizer-type HuggingFaceTokenizer: Megatron-LM's tokenizer reads "
     "it, this project's does not (read here by GPT2BPETokenizer only): give the tokenizer's "
     "directory"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="{hf}/tokenizer.json",
          merge_file="{hf}/tokenizer.json", tokenizer_hf_include_special_tokens=True),
     "--tokenizer-hf-include-special-tokens with --tokenizer-type GPT2BPETokenizer"),
    (dict(tokenizer_type="TikTokenizer", tokenizer_model="{hf}/tokenizer.json"),
     "needs --tiktoken-pattern v1 or v2"),
    (dict(tokenizer_type="SentencePieceTokenizer"), "needs --tokenizer-model"),
])
def test_refused(hf, kw, message):
    kw = {k: v.format(hf=hf) if isinstance(v, str) else v for k, v in kw.items()}
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        flags.check_tokenizer_flags(_args(**kw))


def test_messages_never_name_none():
    # No --tokenizer-type is NullTokenizer in every message.
    args = _args(vocab_size=5, tiktoken_pattern="v1", tokenizer_hf_include_special_tokens=True)
    flags.check_tokenizer_flags(args)
    assert not [line for line in flags.ignored_tokenizer_flags(args) if "None" in line]


def test_the_pattern_names_are_the_tokenizer_patterns():
    assert tuple(tk.TIKTOKEN_PATTERNS) == flags.TIKTOKEN_PATTERN_NAMES
