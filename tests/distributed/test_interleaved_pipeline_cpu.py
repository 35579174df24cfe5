"""Interleaved 1F1B on the CPU: PP=2 with 2 model chunks per rank trains as PP=1 does.

Both layouts start from the same weights, a PP=1 checkpoint of iteration 2 loaded without
its optimizer state (which is laid out per pipeline stage), train to 4, save, and resume
from their own checkpoints to 6 (the interleaved one: 2 chunks per rank, the distributed
optimizer over both). Both go through the same save and resume, so Adam's step count
(restored from the iteration count) is the same in both. Dropout is off: the layouts draw
random numbers on different ranks.
"""

from __future__ import annotations

import pytest

from mext_testing import TINY, losses_of, read_metrics, run_pretrain

BASE = [*TINY, "--num-layers", "4", "--global-batch-size", "16", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--use-distributed-optimizer", "--log-interval", "1",
        "--eval-iters", "0", "--lr-decay-style", "linear", "--lr-warmup-iters", "0",
        "--train-iters", "6"]
VPP = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]


def _from_start_and_resumed(tmp_path, name, start, layout, nproc):
    ckpt, first, second = (tmp_path / f"{name}{s}" for s in ("_ckpt", "_1.jsonl", "_2.jsonl"))
    out = run_pretrain([*BASE, *layout, "--load", str(start), "--no-load-optim", "--save",
                        str(ckpt), "--exit-interval", "4", "--metrics-path", str(first)],
                       nproc=nproc).stdout
    run_pretrain([*BASE, *layout, "--load", str(ckpt), "--metrics-path", str(second)],
                 nproc=nproc)
    return out, losses_of(read_metrics(first)) + losses_of(read_metrics(second))


def test_interleaved_pp2_matches_pp1_and_resumes(tmp_path):
    start = tmp_path / "start"
    run_pretrain([*BASE, "--save", str(start), "--exit-interval", "2"])
    _, reference = _from_start_and_resumed(tmp_path, "pp1", start, [], 1)
    out, interleaved = _from_start_and_resumed(tmp_path, "vpp", start, VPP, 2)
    assert "interleaved: 2 model chunks per pipeline rank" in out
    assert len(reference) == 4
    assert interleaved == pytest.approx(reference, rel=1e-5, abs=0)
