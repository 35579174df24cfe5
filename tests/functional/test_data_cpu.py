"""Real .bin/.idx data: a weighted blend of two prefixes, the split, and evaluation."""

from __future__ import annotations

import numpy as np

from mext_testing import TINY, read_metrics, run_pretrain, write_indexed_dataset


def test_weighted_blend_trains_and_evaluates(tmp_path):
    rng = np.random.default_rng(0)
    # Two corpora with learnable structure: counting up (a) and counting down (b).
    a = [list(range(s, s + 60)) for s in rng.integers(0, 40, 200)]
    b = [list(range(s + 60, s, -1)) for s in rng.integers(0, 40, 200)]
    write_indexed_dataset(tmp_path / "a_text_document", a)
    write_indexed_dataset(tmp_path / "b_text_document", b)
    args = [a for a in TINY if a not in ("--mock-data",)]
    i = args.index("--vocab-size")
    del args[i:i + 2]
    i = args.index("--eval-iters")
    del args[i:i + 2]
    metrics = tmp_path / "m.jsonl"
    out = run_pretrain([
        *args, "--data-path", "0.7", str(tmp_path / "a_text_document"), "0.3",
        str(tmp_path / "b_text_document"), "--split", "90,10,0", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "128", "--train-iters", "20", "--eval-interval", "10",
        "--eval-iters", "2", "--data-cache-path", str(tmp_path / "cache"),
        "--metrics-path", str(metrics)]).stdout
    assert "validation loss at iteration 10" in out
    records = read_metrics(metrics)
    train = [r for r in records if "lm_loss" in r]
    evals = [r for r in records if "eval/lm_loss" in r]
    assert [r["iteration"] for r in evals] == [10, 20]
    assert evals[1]["eval/lm_loss"] < evals[0]["eval/lm_loss"]
    assert train[-1]["lm_loss"] < 0.7 * train[0]["lm_loss"]
    # The breakdown of each iteration fits in it (evaluation is not counted as training).
    for r in train:
        parts = r["time/forward_s"] + r["time/backward_s"] + r["time/optimizer_s"]
        assert parts <= 1.05 * r["time/iteration_s"] + 1e-3, r
    # megatron-core built its blend and split caches where we asked.
    assert any((tmp_path / "cache").iterdir())
