"""ZenFlow's re-selection on a real GPU with the CPU side's states in offload engines.

On a GPU the upload buffers (the CPU update's bf16 weights, waiting for the H2D copy) are
page-locked and reused across re-selections, so a re-selection's new offload engine fills
its weights into the memory where the old engine's masters keep their bf16 half
(remainders) while later pieces of the fill still read the old masters
(``zenflow/kept_weights.py``). Here many small subgroups and a re-selection every window
(both fill orders: they alternate with the step) make each fill cross that memory many
times; the states and weights must equal those of the states in host memory bit for bit.
Run on the lent H200 machine; skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run tests/gpu on the GPU machine)")

HPARAMS = [{"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
           {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0}]


def _states_kinds(engine):
    """The CPU side's states (through its interface) and the GPU side's, on the host."""
    out = {}
    for group, n in engine.cpu_plan.sizes.items():
        parts = [torch.empty(n) for _ in range(3)]
        engine.states.read(group, 0, n, parts)
        out[("cpu", group)] = parts
    for kind, groups in engine.gpu.items():
        for group, tensor in groups.items():
            out[("gpu", kind, group)] = tensor.float().cpu()
    return out


def _run(tmp_path, tiers: bool, steps: int = 14):
    """ZenFlowEngine over bf16 CUDA parameters, windows of 2 steps, re-selected every 2.

    Returns (weights on the host, states, the KeptWeights each re-selection made or None).
    """
    from megatron_ext.offload.config import OffloadConfig
    from megatron_ext.offload.paths import TierSpec
    from megatron_ext.optim.sharded_optimizer import Shard
    from megatron_ext.zenflow import cpu_states
    from megatron_ext.zenflow.config import ZenFlowConfig
    from megatron_ext.zenflow.cpu_states import TieredCpuStates, offload_engines
    from megatron_ext.zenflow.engine import ZenFlowEngine

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(3)
    shards = []
    # A DP shard cuts the first matrix mid-row (its pieces are segments of rows).
    for shape, group, (lo, hi) in (((96, 40), 0, (0.1, 1.0)), ((40,), 1, (0.0, 1.0)),
                                   ((48, 72), 0, (0.0, 0.85)), ((72, 56), 1, (0.0, 1.0))):
        param = torch.nn.Parameter(torch.randn(shape, device=device, generator=gen)
                                   .bfloat16(), requires_grad=False)
        param.main_grad = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        n = param.numel()
        shards.append(Shard(model_param=param, group=group, start=int(lo * n),
                            end=int(hi * n), counts_in_norm=True))
    cfg = ZenFlowConfig(zenflow=True, zenflow_topk_ratio=0.2, zenflow_update_interval="2",
                        zenflow_select_interval=2, zenflow_accumulate="host")
    kept = []
    states = None
    if tiers:
        paths = []
        for i in range(2):
            (tmp_path / f"tier{i}").mkdir(exist_ok=True)
            paths.append(TierSpec(str(tmp_path / f"tier{i}"), read_gbps=2.0 - i,
                                  write_gbps=1.0))
        # Subgroups of 97 elements (they cut groups, segments and rows), a cache of 4.
        offload = OffloadConfig(offload_optimizer=True, offload_paths=[p.path for p in paths],
                                offload_subgroup_size=97,
                                offload_host_cache_gb=4 * 97 * 10 / 1e9)
        states = TieredCpuStates(offload_engines(offload, "gpu-reselect", paths, rank=0,
                                                 model_dtype=torch.bfloat16, fused_adam=True))
        original = cpu_states.keep_for

        def recording(old, new):
            kept.append(original(old, new))
            return kept[-1]
        cpu_states.keep_for = recording
    engine = ZenFlowEngine(cfg, shards, device=device, model_dtype=torch.bfloat16,
                           grad_dtype=torch.bfloat16, cpu_states=states)
    try:
        for step in range(1, steps + 1):
            for shard in shards:
                shard.model_param.main_grad.copy_(torch.randn(
                    shard.model_param.shape, device=device, generator=gen) * (1 + step))
            engine.step(HPARAMS, None, 0.5 if step % 5 == 0 else None)
        engine.cpu.wait_update()
        torch.cuda.synchronize()
        return ([s.weights().float().cpu() for s in shards], _states_kinds(engine), kept)
    finally:
        if tiers:
            cpu_states.keep_for = original
        engine.close()


def test_reselection_into_reused_pinned_buffers_keeps_every_state(tmp_path):
    host_weights, host_states, _ = _run(tmp_path, tiers=False)
    weights, states, kept = _run(tmp_path, tiers=True)
    # The page-locked upload buffers were reused: new engines wrote where old ones read.
    assert sum(k is not None for k in kept) >= 3, kept
    for i, (a, b) in enumerate(zip(host_weights, weights)):
        assert torch.equal(a, b), f"weights of param {i}"
    assert host_states.keys() == states.keys()
    for key in host_states:
        expected, got = host_states[key], states[key]
        if isinstance(expected, list):
            for kind, x, y in zip(("master", "exp_avg", "exp_avg_sq"), expected, got):
                assert torch.equal(x, y), (key, kind)
        else:
            assert torch.equal(expected, got), key
    assert list(tmp_path.rglob("sg*")) == []  # every engine's files removed
