"""The same training on a real GPU (run on the lent H200 machine; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from mext_testing import (
    BF16,
    GPU_TINY,
    assert_loss_falls,
    losses_of,
    precision_flags,
    read_metrics,
    run_pretrain,
    straight_and_resumed,
    train_losses,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run tests/gpu on the GPU machine)")


def test_bf16_trains_on_cuda_and_loss_falls(tmp_path):
    metrics = tmp_path / "m.jsonl"
    out = run_pretrain([*GPU_TINY, *BF16, "--use-distributed-optimizer", "--train-iters", "30",
                        "--metrics-path", str(metrics)]).stdout
    assert "cuda x1" in out
    losses = train_losses(metrics)
    assert len(losses) == 30
    assert_loss_falls(losses)
    record = read_metrics(metrics)[-1]
    assert record["memory/gpu_max_allocated_gib"] > 0


def test_sdpa_matches_unfused_attention_on_cuda(tmp_path):
    """The SDPA core attention computes what megatron-core's unfused attention does."""
    curves = {}
    for backend in ("sdpa", "unfused"):
        metrics = tmp_path / f"{backend}.jsonl"
        run_pretrain([*GPU_TINY, "--train-iters", "5", "--attention-backend", backend,
                      "--hidden-dropout", "0", "--attention-dropout", "0",
                      "--metrics-path", str(metrics)])
        curves[backend] = train_losses(metrics)
    assert curves["sdpa"] == pytest.approx(curves["unfused"], rel=2e-3)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_matches_on_cuda(tmp_path, precision):
    """GPU kernels may reorder sums between processes: equal within a tight tolerance."""
    flags = [*GPU_TINY, "--train-iters", "16", "--use-distributed-optimizer",
             *precision_flags(precision)]
    straight, resumed = straight_and_resumed(tmp_path, flags, stop_at=8)
    assert losses_of(resumed) == pytest.approx(losses_of(straight), rel=1e-4)


def test_megatron_host_offload_runs_on_cuda(tmp_path):
    """megatron-core's --optimizer-cpu-offload (the baseline) runs through the seam."""
    metrics = tmp_path / "m.jsonl"
    run_pretrain([*GPU_TINY, *BF16, "--use-distributed-optimizer", "--optimizer-cpu-offload",
                  "--optimizer-offload-fraction", "1.0", "--train-iters", "10",
                  "--metrics-path", str(metrics)])
    losses = train_losses(metrics)
    assert len(losses) == 10 and losses[-1] < losses[0]
