"""Remainders on a real GPU: the device tier, the streamed update and the CPU updater's
pinned stages, bit for bit against whole masters (run on the lent H200 machine; skipped
elsewhere).

Each test runs two engines on the same inputs, masters as remainders (the default with
bf16 weights) and whole (``store_param_remainders=False``), with the same Adam on each
side (the GPU's fused one on the device, the CPU's on the host), so the results must agree
bit for bit: the weights, and the states, where the remainders' are rebuilt on the CPU
from the GPU's stored bytes and the model's weights (the CPU reconstruction).

The device side runs torch's passes here (``MEGATRON_EXT_DEVICE_ADAM=torch``): the one-pass
kernel, the default on CUDA, exists for remainders only, so whole masters have no twin of
it; tests/gpu/test_gpu_device_adam.py holds it bit for bit to the host kernel.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.offload.config import OffloadConfig
from megatron_ext.offload.engine import OffloadEngine
from megatron_ext.offload.masters import read_masters
from megatron_ext.offload.subgroups import ShardParam
from megatron_ext.offload.tier_model import TierKind
from mext_testing import BF16, GPU_TINY, losses_of, read_metrics, run_pretrain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run tests/gpu on the GPU machine)")

SIZES = [37, 1000, 5, 2048, 300, 129]


@pytest.fixture(autouse=True)
def _torch_device_adam(monkeypatch):
    """torch's AdamW passes on both sides (the engines here and the runs' processes)."""
    monkeypatch.setenv("MEGATRON_EXT_DEVICE_ADAM", "torch")

GROUPS = [0, 1, 0, 1, 0, 1]
HPARAMS = [{"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0},
           {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}]
SG = 700  # elements per subgroup: 6 subgroups, the last of 19


class Shard:
    """bf16 weights and gradients on the device, the same for every seed-0 shard."""

    def __init__(self, device):
        gen = torch.Generator().manual_seed(0)
        self.weights = [torch.randn(n, generator=gen).bfloat16().to(device) for n in SIZES]
        self.grads = [torch.zeros(n, dtype=torch.bfloat16, device=device) for n in SIZES]
        self.gen = torch.Generator().manual_seed(1)

    def new_grads(self, step):
        gen = torch.Generator().manual_seed(100 + step)
        for g in self.grads:
            g.copy_(torch.randn(g.numel(), generator=gen) * 0.1)

    def params(self):
        return [ShardParam(numel=n, group=GROUPS[i], grad=lambda i=i: self.grads[i],
                           out=self.weights[i], init=lambda i=i: self.weights[i])
                for i, n in enumerate(SIZES)]


def _engine(shard, device, remainders, **cfg):
    # No device tier unless a test asks (auto, the default, would take the GPU's room).
    cfg.setdefault("offload_device_cache_gb", "0")
    config = OffloadConfig(offload_optimizer=True, offload_subgroup_size=SG,
                           store_param_remainders=remainders, **cfg)
    return OffloadEngine(config, shard.params(), rank=0, device=torch.device(device), tiers=[],
                         run_id=f"gpu-remainders-{remainders}", model_dtype=torch.bfloat16,
                         grad_dtype=torch.bfloat16)


def _cpu_reconstruction(engine, index):
    """[master, exp_avg, exp_avg_sq] of a subgroup, decoded on the CPU from its stored
    bytes (copied off the GPU, or the pinned host buffer) and the model's weights."""
    n = engine.subgroups[index].numel
    stored = engine._acquire_sync(index)[:engine.sizes[index]].cpu()
    weights = engine._weights_of(index, torch.device("cpu"))
    views = engine.layout.views(stored, n)
    outs = [torch.empty(n), torch.empty_like(views[1]), torch.empty_like(views[2])]
    read_masters(engine.layout, views, 0, n, weights, outs)
    return outs


def _run_pair(device, steps=6, **cfg):
    """The remainders engine and the whole-masters engine after ``steps`` equal steps."""
    shards = [Shard(device), Shard(device)]
    engines = [_engine(shards[0], device, True, **cfg), _engine(shards[1], device, False, **cfg)]
    try:
        assert engines[0].layout.remainders and not engines[1].layout.remainders
        for step in range(steps):
            clip = 0.5 if step == 2 else None
            for shard, engine in zip(shards, engines):
                shard.new_grads(step)
                engine.step(HPARAMS, None, clip)
            if device != "cpu":
                torch.cuda.synchronize()
            for a, b in zip(shards[0].weights, shards[1].weights):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), \
                    f"step {step + 1}: weights differ"
        for engine in engines:
            engine.wait_io()
        for index in range(len(engines[0].subgroups)):
            got = _cpu_reconstruction(engines[0], index)
            want = _cpu_reconstruction(engines[1], index)
            for kind, x, y in zip(("master", "exp_avg", "exp_avg_sq"), got, want):
                assert torch.equal(x, y), f"subgroup {index}: {kind} differs"
        return [engines[0].tier_of(i).kind for i in range(len(engines[0].subgroups))], \
            engines[0].metrics()
    finally:
        for engine in engines:
            engine.close()


def test_device_tier_remainders_equal_whole_masters_on_cuda():
    kinds, record = _run_pair("cuda", offload_device_cache_gb="1")
    assert set(kinds) == {TierKind.DEVICE}
    assert record["offload/state_bytes_per_element"] == 10
    # The device tier holds 10 bytes per element on the GPU, not 12.
    assert record["offload/device_tier_cuda_gib"] * 2**30 == pytest.approx(
        sum(SIZES) * 10, abs=4 * 6)


def test_streamed_update_remainders_equal_whole_masters_on_cuda():
    kinds, record = _run_pair("cuda", offload_stream_share=1.0)
    assert set(kinds) == {TierKind.HOST}
    assert record["offload/streamed_subgroups"] > 0


@pytest.mark.parametrize("delayed", [True, False], ids=["pinned-stages", "fp32-first"])
def test_cpu_updater_remainders_equal_whole_masters_on_cuda(delayed):
    """CPU Adam on pinned host states: the bf16 weights D2H beside the gradients, the new
    ones H2D from the write-back's pinned stages (or, without delayed conversion, read
    synchronously)."""
    kinds, record = _run_pair("cuda", offload_gpu_update=False,
                              offload_delayed_grad_conversion=delayed)
    assert set(kinds) == {TierKind.HOST}
    assert record["offload/streamed_subgroups"] == 0


def test_all_tiers_mixed_remainders_equal_whole_masters_on_cuda():
    """Device tier (two full subgroups and the small one), host cache, half of the rest
    streamed, half CPU Adam."""
    sg_bytes = SG * 10
    kinds, record = _run_pair("cuda", offload_device_cache_gb=str(2.5 * sg_bytes / 1e9),
                              offload_stream_share=0.5)
    assert TierKind.DEVICE in kinds and TierKind.HOST in kinds
    assert record["offload/streamed_subgroups"] > 0


BASE = [*GPU_TINY, *BF16, "--use-distributed-optimizer", "--train-iters", "20",
        "--hidden-dropout", "0", "--attention-dropout", "0"]


def test_pretrain_remainders_equal_whole_masters_on_cuda(tmp_path):
    """A whole run: device tier (GPU Adam) and host subgroups (CPU Adam, no streamed
    update, whose split follows timings): the same losses bit for bit, 10 vs 12 bytes."""
    flags = [*BASE, "--offload-optimizer", "--offload-subgroup-size", "10000",
             # 270 kB: two 10000-element subgroups at 12 B/element and at 10, so both runs
             # update the same subgroups on the GPU (fused Adam) and the same on the CPU.
             "--offload-device-cache-gb", "0.00027", "--no-offload-gpu-update"]
    got = {}
    for name, extra in (("remainders", []), ("whole", ["--no-store-param-remainders"])):
        out = tmp_path / f"{name}.jsonl"
        run_pretrain([*flags, *extra, "--metrics-path", str(out)])
        records = read_metrics(out)
        last = [r for r in records if "offload/cache_hit_rate" in r][-1]
        assert last["offload/state_bytes_per_element"] == (10 if name == "remainders" else 12)
        assert last["offload/device_subgroups_n"] == 2
        got[name] = losses_of(records)
    assert got["remainders"] == got["whole"]
