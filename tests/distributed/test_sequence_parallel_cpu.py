"""--sequence-parallel at TP=2 on the CPU (gloo): the same training as without it.

Sequence parallelism only changes where the activations outside the tensor-parallel
regions live (each TP rank holds half the sequence), so without dropout the losses and
gradient norms equal those of plain TP=2. The norms are this project's (model/norm.py):
torch's refuse sequence parallelism; here also zero-centered (--apply-layernorm-1p).
"""

from __future__ import annotations

import pytest

from mext_testing import TINY, read_metrics, run_pretrain


def test_sequence_parallel_matches_plain_tensor_parallel(tmp_path):
    flags = [*TINY, "--train-iters", "3", "--tensor-model-parallel-size", "2",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--apply-layernorm-1p",
             "--qk-layernorm"]
    runs = {}
    for name, extra in (("sp", ["--sequence-parallel"]), ("tp", [])):
        metrics = tmp_path / f"{name}.jsonl"
        run_pretrain([*flags, *extra, "--metrics-path", str(metrics)], nproc=2)
        runs[name] = [r for r in read_metrics(metrics) if "lm_loss" in r]
    assert len(runs["sp"]) == len(runs["tp"]) == 3
    for sp, tp in zip(runs["sp"], runs["tp"]):
        assert sp["lm_loss"] == pytest.approx(tp["lm_loss"], rel=1e-6)
        assert sp["grad_norm"] == pytest.approx(tp["grad_norm"], rel=1e-5)
