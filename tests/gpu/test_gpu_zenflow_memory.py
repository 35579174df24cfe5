"""ZenFlow's host memory on a real GPU: one page-locked accumulator for both windows with
device accumulation, allocated once after the place is decided (Llama-3-8B's --zenflow was
killed by the host OOM killer at its first step, bench/results/2026-12-03c-h200 call2)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run tests/gpu on the GPU machine)")


@pytest.mark.parametrize("place", ["device", "host"])
def test_host_accumulators_on_cuda(place, monkeypatch):
    from megatron_ext.optim.sharded_optimizer import Shard
    from megatron_ext.zenflow import cpu_worker
    from megatron_ext.zenflow.config import ZenFlowConfig
    from megatron_ext.zenflow.engine import ZenFlowEngine
    from tests.unit.zenflow.test_engine import CASES, HPARAMS, PARAMS, clip_for, grads_for

    made = []
    alloc = cpu_worker.CpuWorker._acc_buffers

    def recording(self, index, sizes):
        out = alloc(self, index, sizes)
        if sizes:
            made.append((engine.place, all(t.is_pinned() for t in out.values())))
        return out
    monkeypatch.setattr(cpu_worker.CpuWorker, "_acc_buffers", recording)
    engine = None
    gen = torch.Generator().manual_seed(0)
    shards = []
    for shape, group, (lo, hi) in PARAMS:
        param = torch.nn.Parameter(torch.randn(shape, generator=gen).to(torch.bfloat16).cuda(),
                                   requires_grad=False)
        param.main_grad = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        n = param.numel()
        shards.append(Shard(model_param=param, group=group, start=int(lo * n),
                            end=int(hi * n), counts_in_norm=True))
    cfg = dataclasses.replace(ZenFlowConfig(zenflow=True, **CASES["S3-k0.25-reselect6-warmup2"]),
                              zenflow_accumulate=place)
    engine = ZenFlowEngine(cfg, shards, device=torch.device("cuda"), model_dtype=torch.bfloat16,
                           grad_dtype=torch.bfloat16)
    try:
        for step in range(1, 15):
            for shard, g in zip(shards, grads_for(step, torch.bfloat16)):
                shard.model_param.main_grad.copy_(g.cuda())
            engine.step(HPARAMS, None, clip_for(step))
            delayed = sum(engine.cpu_plan.sizes.values())
            windows = 1 if place == "device" else 2
            assert engine.cpu.host_bytes() - engine.states.host_bytes() == 4 * windows * delayed
        engine.cpu.wait_update()
        # Made only once the place is known; page-locked where the device's sums arrive.
        assert made and all(p == place and pinned == (place == "device") for p, pinned in made)
        if place == "device":
            assert all(engine.cpu.acc[0][g] is engine.cpu.acc[1][g] for g in engine.cpu.acc[0])
    finally:
        engine.close()
