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
