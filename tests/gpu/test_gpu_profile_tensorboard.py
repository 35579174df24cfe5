"""--profile's nsys range and --log-memory-to-tensorboard on a real GPU (skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from mext_testing import GPU_TINY, run_pretrain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run tests/gpu on the GPU machine)")


def test_nsys_range_and_memory_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    out = run_pretrain([*GPU_TINY, "--bf16", "--train-iters", "4", "--lr-decay-style", "linear",
                        "--profile", "--profile-step-start", "1", "--profile-step-end", "3",
                        "--tensorboard-dir", str(tb), "--log-memory-to-tensorboard"]).stdout
    assert "cudaProfilerStart before iteration 2" in out
    assert "cudaProfilerStop after iteration 3" in out
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    allocated = {e.step: e.value for e in acc.Scalars("mem-max-allocated-bytes")}
    assert sorted(allocated) == [1, 2, 3, 4] and min(allocated.values()) > 0
    assert [e.step for e in acc.Scalars("lm loss")] == [1, 2, 3, 4]
