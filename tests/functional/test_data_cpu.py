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


def test_empty_validation_split_skips_evaluation_in_one_line(tmp_path):
    """--split 100,0,0 with evaluation on: one line at start says evaluation is skipped,
    and no validation loss (nan, as it was) is ever printed or recorded (issue 39)."""
    rng = np.random.default_rng(0)
    write_indexed_dataset(tmp_path / "c_text_document",
                          [rng.integers(0, 100, 40).tolist() for _ in range(50)])
    args = [a for a in TINY if a != "--mock-data"]
    for flag in ("--vocab-size", "--eval-iters"):
        i = args.index(flag)
        del args[i:i + 2]
    metrics = tmp_path / "m.jsonl"
    out = run_pretrain([
        *args, "--data-path", str(tmp_path / "c_text_document"), "--split", "100,0,0",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--train-iters", "4",
        "--eval-interval", "2", "--eval-iters", "2", "--metrics-path", str(metrics)]).stdout
    line = ("validation split is empty (--split 100,0,0): evaluation is skipped; give the "
            "split a validation share to evaluate")
    assert out.count(line) == 1, out[-3000:]
    assert "nan" not in out.lower(), out[-3000:]
    assert "validation loss" not in out, out[-3000:]
    assert not [r for r in read_metrics(metrics) if "eval/lm_loss" in r]
