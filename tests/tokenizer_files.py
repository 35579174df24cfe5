"""Tiny tokenizer files of every --tokenizer-type, made in the test (nothing downloaded)."""

from __future__ import annotations

import base64
import io
import json
import os
import random
from typing import List

WORDS = ("the quick brown fox jumps over lazy dog and then runs into forest where "
         "many other animals live together in peace hello world data model train").split()


def corpus(n: int = 300, seed: int = 0) -> List[str]:
    """``n`` short deterministic sentences of WORDS."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 25))) + "."
            for _ in range(n)]


def make_sentencepiece(path: str, pad: bool = True) -> str:
    """A 120-piece BPE SentencePiece model (ids 0-2 <unk> <s> </s>, 3 <pad> with ``pad``)."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_writer=model, vocab_size=120,
        model_type="bpe", pad_id=3 if pad else -1, num_threads=1, minloglevel=2)
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return path


def make_gpt2_bpe(directory: str):
    """GPT-2 style vocab.json and merges.txt (byte-level BPE with <|endoftext|>)."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(corpus(), vocab_size=300, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    os.makedirs(directory, exist_ok=True)
    vocab, merges = tok.save_model(directory)
    return vocab, merges


def make_hf_dir(directory: str) -> str:
    """A Hugging Face tokenizer directory: tokenizer.json that adds <s> before each text,
    and tokenizer_config.json naming <s> / </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                   "eos_token": "</s>", "unk_token": "<unk>"}, f)
    return directory


TIKTOKEN_MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"an", b"and",
                   b" a", b" an", b" and", b"er", b"ov", b"over", b" o", b" over"]


def make_tiktoken_json(path: str) -> str:
    """Megatron-LM's TikTokenizer vocabulary: the 256 bytes, then TIKTOKEN_MERGES."""
    tokens = [bytes([i]) for i in range(256)] + TIKTOKEN_MERGES
    entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                "token_str": t.decode("utf-8", errors="replace")} for i, t in enumerate(tokens)]
    with open(path, "w") as f:
        json.dump(entries, f)
    return path


TIKTOKEN_VOCAB = 256 + len(TIKTOKEN_MERGES)
