"""tools/generate.py and tools/evaluate.py on the GPU (the lent machine; skipped elsewhere)."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from mext_testing import GPU_TINY, ROOT, read_metrics, run_pretrain, test_env, write_indexed_dataset

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run tests/gpu on the GPU machine)")


def _tool(name, *args):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / name), *map(str, args)],
                          cwd=ROOT, env=test_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_generate_and_evaluate_a_bf16_checkpoint_on_cuda(tmp_path):
    rng = np.random.default_rng(0)
    prefix = tmp_path / "data"
    write_indexed_dataset(prefix, [rng.integers(0, 200, 300).tolist() for _ in range(80)])
    data = ["--data-path", str(prefix), "--tokenizer-type", "NullTokenizer", "--vocab-size", "250",
            "--split", "90,10,0"]
    flags = [a for a in GPU_TINY if a != "--mock-data"]
    metrics = tmp_path / "m.jsonl"
    run_pretrain([*flags, *data, "--bf16", "--train-iters", "6", "--eval-interval", "3",
                  "--eval-iters", "2", "--lr-decay-style", "cosine", "--save", str(tmp_path / "ck"),
                  "--metrics-path", str(metrics)])
    logged = [r for r in read_metrics(metrics) if "eval/lm_loss" in r][-1]
    out = _tool("evaluate.py", "--load", tmp_path / "ck", "--data-path", prefix, "--device", "cuda",
                "--metrics-path", tmp_path / "e.jsonl")
    (record,) = read_metrics(tmp_path / "e.jsonl")
    assert math.isclose(record["eval/lm_loss"], logged["eval/lm_loss"], rel_tol=1e-3), out
    text = _tool("generate.py", "--load", tmp_path / "ck", "--prompt", "1 2 3",
                 "--max-new-tokens", "5", "--greedy", "--no-stop-at-eod", "--device", "cuda")
    assert len(text.split()) == 5 and all(0 <= int(t) < 251 for t in text.split()), text
