"""Fixtures for the corpus tools' tests: a small real corpus and a tiny tokenizer.

Both are built once per session with the tools themselves (as subprocesses, the way a
user runs them), so every other test starts from files the tools really produce.
"""

from __future__ import annotations

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
# Explicit, so that `import tools_testlib` (beside this file) and `import preprocess_data`
# (a tool) work under any pytest --import-mode; the tools themselves import their helpers
# as the top-level module `_common`, as they do when run as scripts.
for _path in (_HERE, os.path.join(os.path.dirname(os.path.dirname(_HERE)), "tools")):
    if _path not in sys.path:
        sys.path.insert(0, _path)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> str:
    """A jsonl corpus of SMALL_CORPUS_DOCS chunks of standard-library source files."""
    # Imported here, not at the top: sys.path is only set up by this module's body.
    from tools_testlib import SMALL_CORPUS_DOCS, SMALL_CORPUS_MAX_CHARS, assert_ok, run_tool

    path = tmp_path_factory.mktemp("corpus") / "small.jsonl"
    assert_ok(run_tool("build_corpus.py", "--output", path, "--max-docs", SMALL_CORPUS_DOCS,
                       "--max-chars", SMALL_CORPUS_MAX_CHARS, "--seed", 1))
    return str(path)


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory, small_corpus) -> str:
    """A TINY_VOCAB-piece BPE SentencePiece model trained on ``small_corpus``; its path."""
    from tools_testlib import TINY_VOCAB, assert_ok, run_tool

    prefix = tmp_path_factory.mktemp("tokenizer") / "tiny"
    assert_ok(run_tool("train_tokenizer.py", "--input", small_corpus, "--output-prefix", prefix,
                       "--vocab-size", TINY_VOCAB, "--num-threads", 1, "--quiet"))
    return f"{prefix}.model"


@pytest.fixture(scope="session")
def finetuned_run(run_cache, tmp_path_factory):
    """A tiny Llama from transformers' random init, converted in, fine-tuned 40 iterations.

    On a repetitive SentencePiece corpus (model_testlib.SENTENCE), with evaluation at
    iterations 20 and 40: the model memorizes the sentence. Made once a session (the
    xdist workers share it; the tests only read it). Returns a namespace with the paths
    (hf_in, ckpt_in, ckpt_out, metrics, tokenizer, prefix).
    """
    import types

    import model_testlib as lib

    def make(root):
        import convert_checkpoint

        from mext_testing import run_pretrain

        tokenizer, prefix = lib.repetitive_corpus(root / "data")
        lib.tiny_hf_llama(root / "hf_in", vocab_size=lib.SP_VOCAB)
        lib.assert_ok(lib.call_tool(convert_checkpoint, "--from", "hf", "--input",
                                    root / "hf_in", "--save", root / "ckpt_in"))
        run_pretrain([*lib.flags_file(root / "ckpt_in"), "--seq-length", "32", *lib.TRAIN,
                      *lib.data_flags(tokenizer, prefix), "--load", str(root / "ckpt_in"),
                      "--finetune", "--train-iters", "40", "--log-interval", "10",
                      "--eval-interval", "20", "--eval-iters", "2", "--save",
                      str(root / "ckpt_out"), "--metrics-path", str(root / "metrics.jsonl")])

    import shutil

    root = run_cache.once("finetuned", make)
    # The corpus copied per worker: megatron-core writes its index cache beside it (not
    # atomically), and two workers' runs must not build the same one at once.
    data = tmp_path_factory.mktemp("finetuned-data")
    shutil.copytree(root / "data", data, dirs_exist_ok=True)
    # The names lib.repetitive_corpus gives them.
    tokenizer, prefix = str(data / "tok.model"), str(data / "rep_text_document")
    assert os.path.isfile(tokenizer) and os.path.isfile(prefix + ".idx")
    return types.SimpleNamespace(root=root, hf_in=root / "hf_in", ckpt_in=root / "ckpt_in",
                                 ckpt_out=root / "ckpt_out", metrics=root / "metrics.jsonl",
                                 tokenizer=tokenizer, prefix=prefix)
