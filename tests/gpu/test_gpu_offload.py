"""--offload-optimizer on a real GPU: pinned buffers, copy streams, events (run on the lent
H200 machine; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from mext_testing import (
    BF16,
    GPU_TINY,
    losses_of,
    read_metrics,
    run_pretrain,
    straight_and_resumed,
    train_losses,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run tests/gpu on the GPU machine)")

BASE = [*GPU_TINY, *BF16, "--use-distributed-optimizer", "--train-iters", "20",
        "--hidden-dropout", "0", "--attention-dropout", "0"]
SMALL = ["--offload-subgroup-size", "10000", "--offload-host-cache-gb", "0.00036"]


def tier_flags(tmp_path, count=2):
    dirs = []
    for i in range(count):
        (tmp_path / f"tier{i}").mkdir(exist_ok=True)
        dirs.append(f"{tmp_path / f'tier{i}'}@{2 - i},1")
    return ["--offload-paths", *dirs, *SMALL]


@pytest.mark.parametrize("layout", ["host-only", "two-paths", "two-paths-all-off"])
def test_offload_on_cuda_follows_the_gpu_optimizer(tmp_path, layout):
    """CPU Adam (fused) vs megatron-core's GPU AdamW: the same curve within rounding."""
    flags = [] if layout == "host-only" else tier_flags(tmp_path)
    if layout.endswith("all-off"):
        flags += ["--no-offload-alternate-order", "--no-offload-delayed-grad-conversion",
                  "--no-offload-concurrency-control", "--no-offload-rebalance"]
    plain, offload = tmp_path / "plain.jsonl", tmp_path / "offload.jsonl"
    run_pretrain([*BASE, "--metrics-path", str(plain)])
    run_pretrain([*BASE, "--offload-optimizer", *flags, "--metrics-path", str(offload)])
    assert train_losses(offload) == pytest.approx(train_losses(plain), rel=2e-3)
    last = [r for r in read_metrics(offload) if "offload/cache_hit_rate" in r][-1]
    assert last["offload/device_state_gib"] == 0
    assert last["memory/gpu_max_allocated_gib"] < \
        [r for r in read_metrics(plain) if "lm_loss" in r][-1]["memory/gpu_max_allocated_gib"]


def test_offload_resume_on_cuda(tmp_path):
    flags = [*BASE, "--offload-optimizer", *tier_flags(tmp_path), "--offload-direct-io"]
    straight, resumed = straight_and_resumed(tmp_path, flags, stop_at=10)
    assert losses_of(resumed) == pytest.approx(losses_of(straight), rel=1e-4)
