"""ZenFlow's host memory at the first step: what it allocates, and in which order.

Llama-3-8B with ``--zenflow`` on an H200 (bench/results/2026-12-03c-h200, call2) was killed
by the host OOM killer at its first step: the plan counts one fp32 window mean on the host
with device accumulation, but both windows' accumulators were allocated (as zeros, before
the place was decided), then copied into page-locked ones: 3 x 28.9 GB at once.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_ext.zenflow import cpu_worker
from megatron_ext.zenflow.config import ZenFlowConfig
from tests.unit.zenflow.test_engine import CASES, HPARAMS, clip_for, grads_for, make_shards


def _engine(place: str, **kwargs):
    from megatron_ext.zenflow.engine import ZenFlowEngine

    cfg = ZenFlowConfig(zenflow=True, **CASES["S3-k0.25-reselect6-warmup2"])
    cfg = dataclasses.replace(cfg, zenflow_accumulate=place)
    shards = make_shards(torch.bfloat16)
    engine = ZenFlowEngine(cfg, shards, device=torch.device("cpu"), model_dtype=torch.bfloat16,
                           grad_dtype=torch.bfloat16, **kwargs)
    return engine, shards


def _step(engine, shards, step):
    for shard, g in zip(shards, grads_for(step, torch.bfloat16)):
        shard.model_param.main_grad.copy_(g)
    engine.step(HPARAMS, None, clip_for(step))


def _acc_bytes(engine) -> int:
    """Bytes of the host accumulators' distinct storages."""
    tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for store in engine.cpu.acc for t in store.values()}
    return sum(tensors.values())


@pytest.mark.parametrize("place,windows", [("device", 1), ("host", 2)])
def test_host_accumulators_are_what_the_plan_counts(place, windows):
    """Device accumulation: one fp32 copy of the delayed columns on the host (the plan's
    "ZenFlow window mean", 4 B/element), through re-selections; host accumulation: two
    (the plan's "ZenFlow accumulators" count 8 B/element besides the staging)."""
    engine, shards = _engine(place)
    try:
        for step in range(1, 15):  # re-selections at 6 and 12 (fresh buffers)
            _step(engine, shards, step)
            delayed = sum(engine.cpu_plan.sizes.values())
            assert _acc_bytes(engine) == 4 * windows * delayed, step
            acc_bytes = engine.cpu.host_bytes() - engine.states.host_bytes()
            assert acc_bytes == 4 * windows * delayed, step
    finally:
        engine.close()


@pytest.mark.parametrize("place", ["device", "host"])
def test_accumulators_are_allocated_after_the_place_is_decided(place, monkeypatch):
    """The host accumulators are made once, the place's way: none exist before the place
    is known (no zero buffers for the page-locked copies to be made from)."""
    seen = []
    made = cpu_worker.CpuWorker._acc_buffers
    engine = None

    def recording(self, index, sizes):
        if sizes:
            seen.append(engine.place)
        return made(self, index, sizes)
    monkeypatch.setattr(cpu_worker.CpuWorker, "_acc_buffers", recording)
    engine, shards = _engine(place)
    try:
        _step(engine, shards, 1)
        assert seen and set(seen) == {place}, seen
    finally:
        engine.close()


def test_shared_accumulator_keeps_a_partial_window():
    """share_accumulators with a partial window in the second buffer (a checkpoint's):
    its sum is the one both windows' buffers hold from then on."""
    worker = cpu_worker.CpuWorker({0: 5, 1: 3}, torch.float32, pin=False)
    try:
        worker.acc[1][0].fill_(2.0)
        worker.acc[1][1].fill_(3.0)
        worker.acc_steps = [0, 2]
        worker.share_accumulators()
        assert worker.shared_acc
        for group, value in ((0, 2.0), (1, 3.0)):
            assert worker.acc[0][group] is worker.acc[1][group]
            assert torch.equal(worker.acc[0][group], torch.full_like(worker.acc[0][group],
                                                                     value))
        assert worker.acc_steps == [0, 2]
        worker.resize({0: 4})  # fresh buffers stay shared
        assert worker.acc[0][0] is worker.acc[1][0]
    finally:
        worker.close()
