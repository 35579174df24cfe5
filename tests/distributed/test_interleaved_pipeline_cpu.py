"""Interleaved 1F1B on the CPU: PP=2 with 2 model chunks per rank trains as PP=1 does.

Both layouts start from the same weights (a PP=1 checkpoint of iteration 2, loaded without
its optimizer state, which is laid out per pipeline stage), so their losses must agree;
then the interleaved run's own checkpoint (2 chunks, distributed optimizer over both)
resumes to the same losses again. Dropout is off: the layouts draw random numbers on
different ranks.
"""

from __future__ import annotations

import pytest

from mext_testing import TINY, losses_of, read_metrics, run_pretrain

BASE = [*TINY, "--num-layers", "4", "--global-batch-size", "16", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--use-distributed-optimizer", "--log-interval", "1",
        "--eval-iters", "0", "--lr-decay-style", "linear", "--lr-warmup-iters", "0"]
VPP = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]


def test_interleaved_pp2_matches_pp1_and_resumes(tmp_path):
    start, ckpt = tmp_path / "start", tmp_path / "vpp_ckpt"
    run_pretrain([*BASE, "--train-iters", "2", "--save", str(start)])
    pp1, vpp, resumed = (tmp_path / f"{n}.jsonl" for n in ("pp1", "vpp", "resumed"))
    from_start = ["--load", str(start), "--no-load-optim", "--train-iters", "6"]
    run_pretrain([*BASE, *from_start, "--metrics-path", str(pp1)])
    out = run_pretrain([*BASE, *VPP, *from_start, "--metrics-path", str(vpp), "--save", str(ckpt),
                        "--exit-interval", "4"], nproc=2).stdout
    assert "interleaved: 2 model chunks per pipeline rank" in out
    run_pretrain([*BASE, *VPP, "--train-iters", "6", "--load", str(ckpt),
                  "--metrics-path", str(resumed)], nproc=2)
    reference = losses_of(read_metrics(pp1))
    assert len(reference) == 4
    interleaved = losses_of(read_metrics(vpp)) + losses_of(read_metrics(resumed))
    assert interleaved == pytest.approx(reference, rel=1e-5, abs=0)
