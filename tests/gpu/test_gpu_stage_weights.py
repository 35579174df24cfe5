"""The weights waiting in host memory while DDP builds its buffers (model/build.py), on a GPU.

A 25.6B bf16 model on one H200 needs it (the start-up would hold the weights three times);
here a tiny one is forced through it (``MEGATRON_EXT_STAGE_WEIGHTS=always``) and trains bit
for bit as without it, and ``auto`` leaves a model that fits alone.
"""

from __future__ import annotations

import pytest
import torch

from mext_testing import BF16, GPU_TINY, run_pretrain, train_losses

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run tests/gpu on the GPU machine)")

STAGED = "start-up: the weights ("


def test_weights_staged_on_the_host_train_bit_for_bit_as_without(tmp_path):
    runs = {}
    for mode in ("always", "never", "auto"):
        metrics = tmp_path / f"{mode}.jsonl"
        out = run_pretrain([*GPU_TINY, *BF16, "--use-distributed-optimizer", "--offload-optimizer",
                            "--train-iters", "6", "--metrics-path", str(metrics)],
                           env={"MEGATRON_EXT_STAGE_WEIGHTS": mode}).stdout
        runs[mode] = (train_losses(metrics), STAGED in out)
    assert runs["always"][1] and not runs["never"][1] and not runs["auto"][1]
    assert runs["always"][0] == runs["never"][0] == runs["auto"][0]
    assert len(runs["always"][0]) == 6
