"""The optimizer-layout check of a checkpoint (megatron_ext/checkpoint/checkpoint_args.py).

A distributed-optimizer state of a sharding type that follows the optimizer's buffers
loads only at the TP and PP it was saved at: refused in one line before anything is built.
"""

from __future__ import annotations

import argparse

import pytest

from megatron_ext.checkpoint.checkpoint_args import (
    check_optimizer_layout,
    optimizer_sharding,
    saved_layout,
)
from megatron_ext.errors import UsageError


def _common(tp=2, pp=1, **args):
    return {"args": argparse.Namespace(tensor_model_parallel_size=tp,
                                       pipeline_model_parallel_size=pp, **args)}


DP_RESHARDABLE = {"distrib_optim_sharding_type": "dp_reshardable"}


@pytest.mark.parametrize("common, metadata, tp, pp, refused", [
    (_common(2, 1), DP_RESHARDABLE, 1, 1, True),
    (_common(1, 2), DP_RESHARDABLE, 1, 1, True),
    (_common(2, 1), DP_RESHARDABLE, 2, 1, False),
    (_common(2, 1), {"distrib_optim_sharding_type": "fully_reshardable"}, 1, 1, False),
    (_common(2, 1), {"distrib_optim_sharding_type": "fully_sharded_model_space"}, 1, 1, False),
    # Not a distributed-optimizer state: megatron-core reshards it.
    (_common(2, 1), {"singleton_local_shards": False}, 1, 1, False),
    # Megatron-LM before mcore 0.13: no content metadata, its rule from args.
    (_common(2, 1, use_distributed_optimizer=True), None, 1, 1, True),
    (_common(2, 1, use_distributed_optimizer=True, ckpt_fully_parallel_save=True), None, 1, 1,
     False),
    (_common(2, 1, use_distributed_optimizer=False), None, 1, 1, False),
    # This project's format 1: the layout from its saved config.
    ({"config": {"parallel": {"tensor_model_parallel_size": 2}}}, DP_RESHARDABLE, 1, 1, True),
    ({}, DP_RESHARDABLE, 1, 1, False),
])
def test_check_optimizer_layout(common, metadata, tp, pp, refused):
    if not refused:
        check_optimizer_layout(common, metadata, tp, pp, "/ck/iter_0000002")
        return
    with pytest.raises(UsageError) as info:
        check_optimizer_layout(common, metadata, tp, pp, "/ck/iter_0000002")
    line = str(info.value)
    assert "\n" not in line
    saved = saved_layout(common)
    assert line.startswith(f"--load /ck/iter_0000002: its optimizer state was saved at "
                           f"TP={saved[0]} PP={saved[1]}")
    assert f"this run has TP={tp} PP={pp}" in line
    assert f"--tensor-model-parallel-size {saved[0]} --pipeline-model-parallel-size {saved[1]}" \
        in line and "--no-load-optim" in line
    assert optimizer_sharding(common, metadata) in line
