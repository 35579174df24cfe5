"""Every --tokenizer-type end to end: tools/preprocess_data.py -> .bin/.idx -> 2 iterations.

The preprocessing runs in this process (tools/preprocess_data.py's main, as the command
line calls it); the trainings run one after the other in one pretrain_gpt.py process (each
process spends seconds importing torch and megatron-core).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import tokenizer_files as tf

from mext_testing import ROOT, TINY, read_metrics
from mext_testing import test_env as _env

sys.path.insert(0, str(ROOT / "tools"))

TRAIN = [a for a in TINY if a not in ("--mock-data",)]
TRAIN = TRAIN[:TRAIN.index("--vocab-size")] + TRAIN[TRAIN.index("--vocab-size") + 2:]
TRAIN += ["--train-iters", "2", "--log-interval", "1", "--eval-iters", "0",
          "--lr-decay-style", "linear", "--split", "100,0,0"]


def _tokenizer_flags(tmp):
    vocab, merges = tf.make_gpt2_bpe(str(tmp / "gpt2"))
    spm = tf.make_sentencepiece(str(tmp / "spm.model"))
    return {
        "GPT2BPETokenizer": ["--vocab-file", vocab, "--merge-file", merges],
        "SentencePieceTokenizer": ["--tokenizer-model", spm],
        "GPTSentencePieceTokenizer": ["--tokenizer-model", spm],
        "Llama2Tokenizer": ["--tokenizer-model", spm],
        "HuggingFaceTokenizer": ["--tokenizer-model", tf.make_hf_dir(str(tmp / "hf"))],
        "TikTokenizer": ["--tokenizer-model", tf.make_tiktoken_json(str(tmp / "tik.json")),
                         "--tiktoken-pattern", "v2", "--tiktoken-num-special-tokens", "10",
                         "--vocab-size", str(tf.TIKTOKEN_VOCAB + 10)],
    }


def test_each_tokenizer_type_preprocesses_and_trains(tmp_path):
    import preprocess_data

    from megatron_ext.data.tokenizer import (
        PREPROCESSING_DIFFERS,
        build_preprocessing_tokenizer,
        build_tokenizer,
    )

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in tf.corpus(200)))
    runs = []
    for kind, flags in _tokenizer_flags(tmp_path).items():
        prefix = tmp_path / kind
        preprocess_data.main(["--input", str(data), "--output-prefix", str(prefix),
                              "--tokenizer-type", kind, *flags, "--append-eod"])
        args = preprocess_data.build_parser().parse_args(
            ["--input", str(data), "--output-prefix", "x", "--tokenizer-type", kind, *flags])
        # Megatron-LM's preprocess_data.py tokenizes with megatron-core's tokenizers (as
        # here by default); --legacy-tokenizer with its training ones (pretrain_gpt.py's).
        tokenizer = build_preprocessing_tokenizer(args)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import IndexedDataset
        ds = IndexedDataset(f"{prefix}_text_document")
        first = tf.corpus(200)[0]
        assert ds[0].tolist() == tokenizer.tokenize(first) + [tokenizer.eod], kind
        assert len(ds) == 200
        training = build_tokenizer(args)
        if kind in PREPROCESSING_DIFFERS:
            assert training.tokenize(first) + [training.eod] != ds[0].tolist(), kind
            preprocess_data.main(["--input", str(data), "--output-prefix", f"{prefix}-legacy",
                                  "--tokenizer-type", kind, *flags, "--append-eod",
                                  "--legacy-tokenizer"])
            legacy = IndexedDataset(f"{prefix}-legacy_text_document")
            assert legacy[0].tolist() == training.tokenize(first) + [training.eod], kind
        else:
            assert training.tokenize(first) + [training.eod] == ds[0].tolist(), kind
        metrics = tmp_path / f"{kind}.jsonl"
        runs.append([*TRAIN, "--data-path", f"{prefix}_text_document", "--tokenizer-type", kind,
                     *flags, "--metrics-path", str(metrics), "--save", str(tmp_path / kind)])
    # All trainings in one process, one after the other; then tools/generate.py on each
    # checkpoint with no tokenizer flags: it must take the run's tokenizer and its files.
    driver = ("import json, os, sys, pretrain_gpt, generate, _common\n"
              "from mext_testing import free_port\n"
              "for args in json.loads(sys.argv[1]):\n"
              "    os.environ['MASTER_PORT'] = str(free_port())\n"
              "    rc = pretrain_gpt.main(args)\n"
              "    assert rc == 0, (rc, args)\n"
              "for args in json.loads(sys.argv[1]):\n"
              "    save = args[args.index('--save') + 1]\n"
              "    print('GENERATE', os.path.basename(save), flush=True)\n"
              "    rc = _common.run_tool(generate.main, ['--load', save, '--prompt', "
              "sys.argv[2], '--max-new-tokens', '3', '--greedy', '--device', 'cpu'])\n"
              "    assert rc == 0, (rc, save)\n")
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(ROOT / "tools")])
    proc = subprocess.run([sys.executable, "-c", driver, json.dumps(runs), "the quick"],
                          cwd=ROOT, env=_env({"PYTHONPATH": path}),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-6000:]
    for kind in _KINDS:
        records = read_metrics(tmp_path / f"{kind}.jsonl")
        assert [r["iteration"] for r in records] == [1, 2], kind
        assert all(math.isfinite(r["lm_loss"]) for r in records), kind
        assert f"GENERATE {kind}\n" in proc.stdout, proc.stdout[-3000:]
    assert "error:" not in proc.stdout, proc.stdout[-3000:]


_KINDS = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
          "Llama2Tokenizer", "HuggingFaceTokenizer", "TikTokenizer")


@pytest.fixture(autouse=True)
def _quiet_tokenizers(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def test_data_of_a_larger_tokenizer_is_refused_before_the_plan(tmp_path):
    """A corpus preprocessed with GPT-2 BPE (300 ids) trained with a SentencePiece model
    (124 ids): refused in one line naming the .bin, its largest id, the vocabulary and the
    flags to fix, before the memory plan and the model (issue 39)."""
    import numpy as np
    import preprocess_data

    from mext_testing import PRETRAIN, assert_one_error_line

    vocab, merges = tf.make_gpt2_bpe(str(tmp_path / "gpt2"))
    spm = tf.make_sentencepiece(str(tmp_path / "spm.model"))
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in tf.corpus(200)))
    prefix = tmp_path / "corpus"
    preprocess_data.main(["--input", str(data), "--output-prefix", str(prefix),
                          "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                          "--merge-file", merges, "--append-eod", "--workers", "1"])
    bin_path = f"{prefix}_text_document.bin"
    largest = int(np.memmap(bin_path, dtype=np.uint16, mode="r").max())
    assert largest >= 124
    proc = subprocess.run(
        [sys.executable, PRETRAIN, *TRAIN, "--data-path", f"{prefix}_text_document",
         "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", spm],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert_one_error_line(
        proc.returncode, proc.stdout, proc.stderr,
        f"{bin_path} holds token id {largest}, outside the vocabulary of 124 ids of "
        "--tokenizer-type SentencePieceTokenizer: give --tokenizer-type/--tokenizer-model/"
        "--vocab-file matching the one tools/preprocess_data.py used")
    assert "memory plan" not in proc.stdout and "building the model" not in proc.stdout
