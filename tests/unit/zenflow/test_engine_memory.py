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


@pytest.mark.parametrize("rows_elements", [1, 16])
def test_reselection_in_the_host_cache_holds_about_one_copy_of_the_states(monkeypatch,
                                                                         rows_elements):
    """--zenflow-cpu-states tiers with every subgroup in the host cache (no paths, the
    Llama-3-8B run's placement): a re-selection fills a new engine from the old one and
    frees each old subgroup after its last read, so the host holds about one copy of the
    CPU side's states, not two (73 GB more at step 100 on the H200); the states stay
    the reference's bit for bit, whatever the row blocks the segments move in."""
    from megatron_ext.zenflow import moves
    from tests.unit.zenflow import test_engine

    monkeypatch.setattr(moves, "ROWS_ELEMENTS", rows_elements, raising=False)
    # Shards of whole rows (a rank's shard at DP=1): every matrix keeps its number of
    # delayed columns, so the new states' rows lie where the old ones' did.
    monkeypatch.setattr(test_engine, "PARAMS", [
        ((12, 10), 0, (0.0, 1.0)), ((13,), 1, (0.0, 1.0)), ((9, 7), 1, (1 / 3, 1.0)),
        ((5,), 0, (0.2, 0.8)), ((16, 8), 0, (0.25, 0.75))])
    from megatron_ext.offload.cache import HostCache
    from megatron_ext.offload.config import OffloadConfig
    from megatron_ext.offload.engine import OffloadEngine
    from tests.unit.zenflow.test_engine import assert_same, run_both

    made, closed, peaks = [], set(), {}
    live = {"max": 0}

    def buffers() -> int:  # host buffers of the engines not closed
        return sum(e.cache.allocated for i, e in enumerate(made) if i not in closed)
    allocate = HostCache.allocate

    def counting_allocate(self):
        buffer = allocate(self)
        live["max"] = max(live["max"], buffers())
        return buffer
    monkeypatch.setattr(HostCache, "allocate", counting_allocate)
    cfg = OffloadConfig(offload_optimizer=True, offload_subgroup_size=7)

    def make(params, generation=0):
        if made:  # a re-selection: the previous engine's buffers are all live
            peaks[len(made)] = [buffers()]
            live["max"] = buffers()
        engine = OffloadEngine(cfg, params, rank=0, device=torch.device("cpu"), tiers=[],
                               run_id=f"test.selection{generation}",
                               model_dtype=torch.bfloat16, grad_dtype=torch.float32)
        made.append(engine)
        return engine

    original_close = OffloadEngine.close

    def closing(self, remove_files=True):
        index = next((i for i, e in enumerate(made) if e is self), None)
        if index is not None and index + 1 in peaks:  # the replaced engine closes
            peaks[index + 1].append(live["max"])
            closed.add(index)
        original_close(self, remove_files)
    monkeypatch.setattr(OffloadEngine, "close", closing)
    zen = ZenFlowConfig(zenflow=True, **CASES["S3-k0.25-reselect6-warmup2"])
    engine, shards, ref, _ = run_both(zen, torch.bfloat16, steps=14, keep_open=True,
                                      make_cpu_engine=make)
    try:
        assert_same(engine, shards, ref)
        assert len(peaks) >= 2, peaks
        # The old engine's buffers and a few more while the new one fills, not both: the
        # subgroup being filled and the old ones its row blocks still straddle (here rows
        # of 6-8 elements, subgroups of 7; without the releases: twice the old engine's).
        for generation, (before, peak) in peaks.items():
            assert before >= 20 and peak <= before + (2 if rows_elements == 1 else 3), \
                (generation, before, peak)
    finally:
        engine.close()
