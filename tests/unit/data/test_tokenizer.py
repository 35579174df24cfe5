"""Tokenizers of every --tokenizer-type: ids, round trip, EOD, Megatron-LM's special cases.

Where an independent implementation of the same algorithm exists it is the reference
(transformers' slow GPT2Tokenizer for GPT-2 BPE, the raw SentencePiece model), otherwise
the expected ids follow from Megatron-LM's rules written out here.
"""

from __future__ import annotations

import argparse

import pytest
import sentencepiece
import tokenizer_files as tf

from megatron_ext.data import tokenizer as tk
from megatron_ext.errors import UsageError

TEXT = "the quick brown fox jumps over the lazy dog, and then runs."


def _args(**kw):
    base = dict(tokenizer_type=None, tokenizer_model=None, vocab_file=None, merge_file=None,
                vocab_size=None, vocab_extra_ids=0, tiktoken_pattern=None,
                tiktoken_num_special_tokens=1000, tokenizer_special_tokens=None,
                tiktoken_special_tokens=None)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    vocab, merges = tf.make_gpt2_bpe(str(d / "gpt2"))
    return {
        "spm": tf.make_sentencepiece(str(d / "spm.model")),
        "spm_nopad": tf.make_sentencepiece(str(d / "nopad.model"), pad=False),
        "vocab": vocab, "merges": merges,
        "hf": tf.make_hf_dir(str(d / "hf")),
        "tiktoken": tf.make_tiktoken_json(str(d / "tik.json")),
    }


def _gpt2_reference(vocab_file, merges_file):
    """GPT-2's BPE as its paper's code describes it, written out plainly (the reference).

    Bytes are mapped to printable characters, the text is cut by GPT-2's regex, and each
    piece's symbols are merged pair by pair, lowest merge rank first.
    """
    import json

    import regex

    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    byte_char, extra = {}, 0
    for b in range(256):
        if b in printable:
            byte_char[b] = chr(b)
        else:
            byte_char[b] = chr(256 + extra)
            extra += 1
    with open(vocab_file, encoding="utf-8") as f:
        encoder = json.load(f)
    with open(merges_file, encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line]
    ranks = {pair: i for i, pair in enumerate(merges)}
    pattern = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+"""
                            r"""| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def encode(text):
        ids = []
        for piece in pattern.findall(text):
            word = [byte_char[b] for b in piece.encode("utf-8")]
            while len(word) > 1:
                pairs = [(ranks.get(p, float("inf")), i) for i, p in enumerate(zip(word, word[1:]))]
                rank, i = min(pairs)
                if rank == float("inf"):
                    break
                first, second = word[i], word[i + 1]
                merged, j = [], 0
                while j < len(word):
                    if j < len(word) - 1 and word[j] == first and word[j + 1] == second:
                        merged.append(first + second)
                        j += 2
                    else:
                        merged.append(word[j])
                        j += 1
                word = merged
            ids.extend(encoder[w] for w in word)
        return ids

    return encoder, encode


def test_gpt2_bpe_matches_the_original_algorithm(files):
    tok = tk.build_tokenizer(_args(tokenizer_type="GPT2BPETokenizer", vocab_file=files["vocab"],
                                   merge_file=files["merges"]))
    encoder, encode = _gpt2_reference(files["vocab"], files["merges"])
    for text in (TEXT, "  two spaces\nnew line's", "ünïcödé ✓ 123"):
        ids = tok.tokenize(text)
        assert ids == encode(text)
        assert tok.detokenize(ids) == text
    assert tok.eod == encoder["<|endoftext|>"]
    assert tok.vocab_size == len(encoder)
    # Megatron-LM parses no special token in the text: <|endoftext|> is its characters.
    assert tok.eod not in tok.tokenize("a<|endoftext|>b")
    assert tok.tokenize_batch([TEXT, "x"]) == [tok.tokenize(TEXT), tok.tokenize("x")]


@pytest.mark.parametrize("model", ["spm", "spm_nopad"])
def test_sentencepiece_tokenizer_adds_megatron_special_tokens(files, model):
    sp = sentencepiece.SentencePieceProcessor(model_file=files[model])
    n = sp.get_piece_size()
    tok = tk.build_tokenizer(_args(tokenizer_type="SentencePieceTokenizer",
                                   tokenizer_model=files[model], vocab_extra_ids=2))
    # <CLS> <SEP> <EOD> <MASK> past the pieces, <PAD> when the model has none, then extras.
    extra = 0 if model == "spm" else 1
    assert tok.eod == n + 2
    assert tok.vocab_size == n + 4 + extra + 2
    assert tok.bos == sp.bos_id() and tok.eos == sp.eos_id()
    ids = tok.tokenize("the fox<EOD>the dog<MASK></s>x<extra_id_1>")
    assert ids == (sp.encode("the fox") + [n + 2] + sp.encode("the dog") + [n + 3, sp.eos_id()]
                   + sp.encode("x") + [n + 4 + extra + 1])
    assert tok.tokenize(TEXT) == sp.encode(TEXT)
    assert tok.detokenize(sp.encode(TEXT) + [n + 2] + sp.encode("dog")) == \
        sp.decode(sp.encode(TEXT)) + " <EOD> dog"


def test_split_at_special_tokens_takes_the_leftmost_then_the_first_listed():
    special = {"<x": 10, "<xy": 11, "<s>": 12}
    # Both <x and <xy match at 1: the first listed wins (Megatron-LM's min over its dict).
    assert list(tk.split_at_special_tokens("a<xyb<s>", special)) == [
        ("a", None), ("<x", 10), ("yb", None), ("<s>", 12), ("", None)]
    reordered = {"<xy": 11, "<x": 10}
    assert list(tk.split_at_special_tokens("a<xyb", reordered)) == [
        ("a", None), ("<xy", 11), ("b", None)]


def test_gpt_sentencepiece_and_llama2(files):
    sp = sentencepiece.SentencePieceProcessor(model_file=files["spm"])
    gpt = tk.build_tokenizer(_args(tokenizer_type="GPTSentencePieceTokenizer",
                                   tokenizer_model=files["spm"]))
    llama = tk.build_tokenizer(_args(tokenizer_type="Llama2Tokenizer",
                                     tokenizer_model=files["spm"]))
    assert gpt.tokenize(TEXT) == sp.encode(TEXT)
    assert gpt.tokenize("a</s>") == sp.encode("a</s>")  # no special-token parsing
    assert llama.tokenize(TEXT) == [sp.bos_id()] + sp.encode(TEXT)
    assert llama.tokenize_batch([TEXT]) == [llama.tokenize(TEXT)]
    for tok in (gpt, llama):
        assert tok.eod == sp.eos_id() == 2
        assert tok.vocab_size == sp.get_piece_size()
        assert tok.detokenize(tok.tokenize(TEXT)) == sp.decode(sp.encode(TEXT))


def test_huggingface_tokenizer_from_a_local_directory_and_a_file(files, monkeypatch):
    import os

    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(os.path.join(files["hf"], "tokenizer.json"))
    tok = tk.build_tokenizer(_args(tokenizer_type="HuggingFaceTokenizer",
                                   tokenizer_model=files["hf"]))
    ids = tok.tokenize(TEXT)
    assert ids == raw.encode(TEXT).ids and ids[0] == raw.token_to_id("<s>")
    assert tok.eod == raw.token_to_id("</s>")
    assert tok.vocab_size == raw.get_vocab_size()
    assert tok.detokenize(ids[1:]) == TEXT
    assert tok.tokenize_batch([TEXT, "dog"]) == [ids, tok.tokenize("dog")]
    bare = tk.build_tokenizer(_args(tokenizer_type="HuggingFaceTokenizer",
                                    tokenizer_model=os.path.join(files["hf"], "tokenizer.json")))
    assert bare.tokenize(TEXT) == ids
    with pytest.raises(UsageError, match="never the hub"):
        tk.HuggingFaceTokenizer("gpt2")  # a hub name, not a local path


def test_tiktokenizer_shifts_ranks_past_the_special_tokens(files):
    vocab = tf.TIKTOKEN_VOCAB + 10
    tok = tk.build_tokenizer(_args(tokenizer_type="TikTokenizer", tokenizer_model=files["tiktoken"],
                                   tiktoken_pattern="v2", tiktoken_num_special_tokens=10,
                                   vocab_size=vocab))
    assert tok.vocab_size == vocab and tok.eod == 2 and tok.bos == 1
    # " the" is merge rank 256 + 4; "the" 256 + 2; shifted by the 10 special tokens.
    assert tok.tokenize("the the") == [10 + 258, 10 + 260]
    assert tok.tokenize("z") == [10 + ord("z")]
    assert tok.tokenize("</s>") == [10 + b for b in b"</s>"]  # encoded as ordinary text
    assert tok.detokenize(tok.tokenize(TEXT)) == TEXT
    v1 = tk.build_tokenizer(_args(tokenizer_type="TikTokenizer", tokenizer_model=files["tiktoken"],
                                  tiktoken_pattern="v1", tiktoken_num_special_tokens=10,
                                  vocab_size=vocab))
    assert v1.detokenize(v1.tokenize(TEXT)) == TEXT
    # Megatron-LM's fillers: given tokens first, then <SPECIAL_i>.
    assert tk.tiktoken_special_tokens(5, 100, ["<unk>", "<s>", "</s>", "<pad>"]) == \
        ["<unk>", "<s>", "</s>", "<pad>", "<SPECIAL_4>"]


@pytest.mark.parametrize("kw, message", [
    (dict(tokenizer_type="GPT2BPETokenizer"), "needs --vocab-file"),
    # Flags Megatron-LM's tokenizer of the type reads and this project's does not (the
    # flags no tokenizer of the type reads are ignored: test_tokenizer_flags.py).
    (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="{hf}", vocab_file="v.json"),
     "--vocab-file with --tokenizer-type HuggingFaceTokenizer: Megatron-LM's tokenizer reads "
     "it, this project's does not"),
    (dict(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model="{spm}",
          tokenizer_special_tokens=["<x>"]), "--tokenizer-special-tokens with"),
    (dict(tokenizer_type="TikTokenizer", tokenizer_model="{tiktoken}"), "--tiktoken-pattern v1"),
    (dict(tokenizer_type="TikTokenizer", tokenizer_model="{tiktoken}", tiktoken_pattern="v1",
          tiktoken_num_special_tokens=10, vocab_size=5000), "give --vocab-size 283"),
    (dict(tokenizer_type="TikTokenizer", tokenizer_model="{tiktoken}", tiktoken_pattern="v1",
          tokenizer_special_tokens=["<s>", "</s>"], vocab_size=2000), "must include <unk>"),
    (dict(tokenizer_type="TikTokenizer", tokenizer_model="{spm}", tiktoken_pattern="v1"),
     "reads a .json vocabulary"),
    (dict(tokenizer_type="Llama2Tokenizer", tokenizer_model="{spm}",
          tiktoken_special_tokens=["<x>"]), "--tiktoken-special-tokens with --tokenizer-type "
                                            "Llama2Tokenizer"),
    (dict(tokenizer_type="Llama2Tokenizer", tokenizer_model="{hf}/tokenizer.json"),
     "not a SentencePiece model"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_tokenizer_flags(files, kw, message):
    kw = {k: v.format(**files) if isinstance(v, str) else v for k, v in kw.items()}
    with pytest.raises(UsageError, match=message):
        tk.build_tokenizer(_args(**kw))


@pytest.mark.parametrize("includes_eod, vocab, eod", [(False, 101, 100), (True, 100, 99)])
def test_null_tokenizer_vocab_as_megatron_lm_at_each_tag(includes_eod, vocab, eod):
    tok = tk.NullTokenizer(100, includes_eod=includes_eod)
    assert (tok.vocab_size, tok.eod) == (vocab, eod)
    assert tok.tokenize("3 1 4") == [3, 1, 4] and tok.detokenize([3, 1, 4]) == "3 1 4"


def test_null_tokenizer_names_a_word_that_is_not_an_id():
    with pytest.raises(ValueError, match="^'hello' is not a token id: NullTokenizer reads text "
                                         "as space-separated token ids$"):
        tk.NullTokenizer(100).tokenize("1 hello 2")


def test_null_tokenizer_follows_the_installed_megatron_core():
    from megatron_ext.runtime.mcore_compat import installed_version, null_vocab_includes_eod

    tok = tk.NullTokenizer(100)
    assert tok.vocab_size == (100 if null_vocab_includes_eod(installed_version()) else 101)
