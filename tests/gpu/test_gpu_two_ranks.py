"""Two processes on two GPUs (nccl): DP=2 and TP=2 train; resume matches (2-GPU machine)."""

from __future__ import annotations

import pytest
import torch

from mext_testing import (
    BF16,
    GPU_TINY,
    assert_loss_falls,
    losses_of,
    run_pretrain,
    straight_and_resumed,
    train_losses,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA GPUs (run tests/gpu on the two-GPU machine)")


@pytest.mark.parametrize("layout", [
    ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
    ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
], ids=["dp2-overlap", "tp2"])
def test_two_gpus_train_bf16_and_loss_falls(tmp_path, layout):
    metrics = tmp_path / "m.jsonl"
    out = run_pretrain([*GPU_TINY, *layout, *BF16, "--train-iters", "30",
                        "--metrics-path", str(metrics)], nproc=2).stdout
    assert "cuda x2" in out
    losses = train_losses(metrics)
    assert len(losses) == 30
    assert_loss_falls(losses)


def test_resume_matches_on_two_gpus(tmp_path):
    flags = [*GPU_TINY, "--train-iters", "16", "--use-distributed-optimizer", *BF16]
    straight, resumed = straight_and_resumed(tmp_path, flags, stop_at=8, nproc=2)
    assert losses_of(resumed) == pytest.approx(losses_of(straight), rel=1e-4)
