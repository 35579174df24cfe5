"""Interleaved schedule's flags: the chunks per pipeline rank and Megatron-LM's rules."""

from __future__ import annotations

import pytest

from megatron_ext.config import parse_config
from megatron_ext.errors import UsageError

BASE = ["--mock-data", "--vocab-size", "100", "--micro-batch-size", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
        "--lr", "1e-3", "--train-iters", "2"]


def _vpp(flags, world=2):
    cfg = parse_config([*BASE, *flags])
    cfg.check_world(world)
    return cfg.virtual_pipeline_size()


@pytest.mark.parametrize("flags, world, want", [
    (["--num-layers", "8", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "4"], 2, 2),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "2",
      "--num-virtual-stages-per-pipeline-rank", "4", "--global-batch-size", "4"], 2, 4),
    # One chunk per rank is no interleaving (Megatron-LM sets no virtual size).
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "2"], 2, None),
    (["--num-layers", "4"], 1, None),
])
def test_chunks_per_rank(flags, world, want):
    assert _vpp(flags, world) == want


@pytest.mark.parametrize("flags, world, message", [
    (["--num-layers", "8", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "3"], 2,
     "layers per pipeline stage .* are not divisible by --num-layers-per-virtual-pipeline"),
    (["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"], 1,
     "needs --pipeline-model-parallel-size >= 2"),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "6"], 2,
     "multiple of --pipeline-model-parallel-size 2"),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "2", "--no-overlap-p2p-communication",
      "--global-batch-size", "4"], 2, "needs --pipeline-model-parallel-size > 2"),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "2", "--num-virtual-stages-per-pipeline-rank",
      "2"], 2, "give one of them"),
])
def test_megatron_rules_are_one_line_errors(flags, world, message):
    with pytest.raises(UsageError, match=message):
        _vpp(flags, world)
