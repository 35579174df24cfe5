"""--zenflow on a real GPU: the D2H stream into pinned staging, the CPU threads beside the
training loop, uploads at window ends (run on the lent H200 machine; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from mext_testing import BF16, GPU_TINY, losses_of, read_metrics, run_pretrain, straight_and_resumed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run tests/gpu on the GPU machine)")

BASE = [*GPU_TINY, *BF16, "--use-distributed-optimizer", "--train-iters", "20",
        "--hidden-dropout", "0", "--attention-dropout", "0"]
MODES = {
    "all-selected": ["--zenflow-topk-ratio", "1.0", "--zenflow-update-interval", "1"],
    "synchronous": ["--zenflow-topk-ratio", "0.3", "--zenflow-full-warmup-steps", "20",
                    "--zenflow-select-interval", "4"],
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_zenflow_on_cuda_follows_the_gpu_optimizer(tmp_path, mode):
    """Where ZenFlow is plain Adam (CPU side synchronous), the curve matches megatron-core's
    GPU AdamW within rounding (fused kernels on both sides, in another order)."""
    plain, zenflow = tmp_path / "plain.jsonl", tmp_path / "zenflow.jsonl"
    run_pretrain([*BASE, "--metrics-path", str(plain)])
    run_pretrain([*BASE, "--zenflow", *MODES[mode], "--metrics-path", str(zenflow)])
    assert losses_of(read_metrics(zenflow)) == pytest.approx(
        losses_of(read_metrics(plain)), rel=2e-3)


def test_zenflow_async_on_cuda(tmp_path):
    out = tmp_path / "zenflow.jsonl"
    run_pretrain([*BASE, "--zenflow", "--zenflow-select-interval", "8",
                  "--metrics-path", str(out)])
    records = [r for r in read_metrics(out) if "lm_loss" in r]
    losses = losses_of(records)
    assert sum(losses[-3:]) < 0.9 * sum(losses[:3])
    # auto accumulates on the GPU (the tiny model's sum fits): one D2H per window, at its end.
    assert all(r["zenflow/accumulate_on_device"] == 1.0 for r in records)
    assert [r["iteration"] for r in records if r["zenflow/d2h_bytes"] > 0] == [4, 8, 12, 16, 20]
    assert sorted(r["iteration"] for r in records if r["zenflow/h2d_bytes"] > 0) == [8, 12, 20]
    assert 0 < records[-1]["zenflow/device_state_gib"] < records[-1]["zenflow/host_state_gib"]


def test_zenflow_losses_do_not_depend_on_the_step_sync(tmp_path):
    """MEGATRON_EXT_STEP_SYNC=stream (the default) lets the D2H of the delayed grads run
    into the next iteration: the streams' events still order every use, so the losses are
    the same bit for bit as with a device-wide synchronize at every timer."""
    flags = [*BASE, "--zenflow", "--zenflow-select-interval", "8"]
    device, stream = tmp_path / "device.jsonl", tmp_path / "stream.jsonl"
    run_pretrain([*flags, "--metrics-path", str(device)], env={"MEGATRON_EXT_STEP_SYNC": "device"})
    run_pretrain([*flags, "--metrics-path", str(stream)])
    assert losses_of(read_metrics(stream)) == losses_of(read_metrics(device))


def test_zenflow_uploads_on_cuda_do_not_depend_on_timing(tmp_path):
    """A finished CPU update's weights are copied to the GPU by the update thread before
    the window's boundary (uploads_ready: the copy had finished when the boundary came),
    or reach it late when the update finishes late (random delays in the CPU threads):
    the same losses bit for bit either way."""
    flags = [*BASE, "--zenflow", "--zenflow-select-interval", "8"]
    prompt, late = tmp_path / "prompt.jsonl", tmp_path / "late.jsonl"
    run_pretrain([*flags, "--metrics-path", str(prompt)])
    run_pretrain([*flags, "--metrics-path", str(late)],
                 env={"MEGATRON_EXT_ZENFLOW_JITTER": "0.2"})
    assert losses_of(read_metrics(late)) == losses_of(read_metrics(prompt))
    ready = [sum(r.get("zenflow/uploads_ready", 0) for r in read_metrics(path))
             for path in (prompt, late)]
    assert ready[0] > 0, ready
    print("uploads on the GPU before the boundary (prompt, late):", ready)


def test_zenflow_resume_on_cuda(tmp_path):
    flags = [*BASE, "--zenflow", "--zenflow-select-interval", "8"]
    straight, resumed = straight_and_resumed(tmp_path, flags, stop_at=6)
    assert losses_of(resumed) == pytest.approx(losses_of(straight), rel=1e-4)


@pytest.mark.parametrize("select_interval", [20, 8])
def test_zenflow_cpu_side_in_offload_tiers_on_cuda(tmp_path, select_interval):
    """The CPU side's states in the offload engine (fused CPU Adam there too): the same
    losses as with them in host memory; with re-selections (every 8 steps) too."""
    tiers = []
    for i in range(2):
        (tmp_path / f"tier{i}").mkdir()
        tiers.append(f"{tmp_path / f'tier{i}'}@{2 - i},1")
    flags = [*BASE, "--zenflow", "--zenflow-select-interval", str(select_interval)]
    memory, offload = tmp_path / "memory.jsonl", tmp_path / "offload.jsonl"
    run_pretrain([*flags, "--metrics-path", str(memory)])
    run_pretrain([*flags, "--offload-optimizer", "--offload-paths", *tiers,
                  "--offload-subgroup-size", "10000", "--offload-host-cache-gb", "0.00036",
                  "--offload-direct-io", "--metrics-path", str(offload)])
    assert losses_of(read_metrics(offload)) == losses_of(read_metrics(memory))


def _engine_on_cuda(place: str, steps: int = 12):
    """ZenFlowEngine over three bf16 CUDA parameters, windows of 3 steps, re-selection every
    6, a clip coefficient every 5th step; returns (weights on the host, engine facts)."""
    from megatron_ext.optim.sharded_optimizer import Shard
    from megatron_ext.zenflow.config import ZenFlowConfig
    from megatron_ext.zenflow.engine import ZenFlowEngine

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(1)
    shards = []
    for shape, group in (((64, 48), 0), ((48,), 1), ((32, 64), 0)):
        param = torch.nn.Parameter(torch.randn(shape, device=device, generator=gen)
                                   .bfloat16(), requires_grad=False)
        param.main_grad = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        shards.append(Shard(model_param=param, group=group, start=0, end=param.numel(),
                            counts_in_norm=True))
    hparams = [{"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
               {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0}]
    cfg = ZenFlowConfig(zenflow=True, zenflow_topk_ratio=0.25, zenflow_update_interval="3",
                        zenflow_select_interval=6, zenflow_accumulate=place)
    engine = ZenFlowEngine(cfg, shards, device=device, model_dtype=torch.bfloat16,
                           grad_dtype=torch.bfloat16)
    try:
        for step in range(1, steps + 1):
            for shard in shards:
                shard.model_param.main_grad.copy_(torch.randn(
                    shard.model_param.shape, device=device, generator=gen) * (1 + step))
            engine.step(hparams, None, 0.5 if step % 5 == 0 else None)
        engine.cpu.wait_update()
        torch.cuda.synchronize()
        facts = {"place": engine.place, "transfers": engine.dev.transfers,
                 "windows": engine.schedule.windows_closed, **engine.metrics()}
        return [s.weights().float().cpu() for s in shards], facts
    finally:
        engine.close()


def test_zenflow_device_accumulation_on_cuda_equals_host_bit_for_bit():
    """The delayed grads summed on the GPU (fused adds, the window's mean in one D2H on the
    side stream, zeroed behind it) give the host accumulation's weights bit for bit, with
    one copy to the host per window."""
    host, host_facts = _engine_on_cuda("host")
    device, facts = _engine_on_cuda("device")
    assert host_facts["place"] == "host" and facts["place"] == "device"
    assert facts["windows"] == 4 and facts["transfers"] == 4  # one D2H per window
    assert facts["zenflow/d2h_copies"] == 4 / 12 and host_facts["zenflow/d2h_copies"] == 1.0
    for a, b in zip(host, device):
        assert torch.equal(a, b)


def test_zenflow_device_accumulation_on_cuda_trains_like_host(tmp_path):
    """pretrain_gpt.py with --zenflow-accumulate device and host: the same losses (within
    rounding; printed whether bit for bit), one D2H of delayed grads per window (at 4, 8,
    ... with S = 4) against one per step, and fewer bytes over PCIe."""
    flags = [*BASE, "--zenflow", "--zenflow-select-interval", "8"]
    runs = {}
    for place in ("host", "device"):
        out = tmp_path / f"{place}.jsonl"
        run_pretrain([*flags, "--zenflow-accumulate", place, "--metrics-path", str(out)])
        runs[place] = [r for r in read_metrics(out) if "lm_loss" in r]
    host, device = (losses_of(runs[p]) for p in ("host", "device"))
    print("device accumulation losses equal to host bit for bit:", host == device)
    assert device == pytest.approx(host, rel=1e-5)
    assert all(r["zenflow/accumulate_on_device"] == 1.0 for r in runs["device"])
    assert [r["iteration"] for r in runs["device"] if r["zenflow/d2h_copies"] > 0] == \
        [4, 8, 12, 16, 20]
    assert all(r["zenflow/d2h_copies"] == 1.0 for r in runs["host"])
    pcie = {p: sum(r["zenflow/pcie_bytes"] for r in runs[p]) for p in runs}
    assert pcie["device"] < pcie["host"], pcie


def test_zenflow_auto_accumulates_on_the_gpu_when_it_has_room(tmp_path):
    """auto (the default) on the GPU: the tiny model's accumulator fits, so device; with
    the free memory forced to nothing (the test hook), host."""
    flags = [*BASE, "--zenflow", "--zenflow-select-interval", "8", "--train-iters", "4"]
    seen = {}
    for name, env in (("room", {}), ("full", {"MEGATRON_EXT_ZENFLOW_DEVICE_FREE_BYTES": "0"})):
        out = tmp_path / f"{name}.jsonl"
        run_pretrain([*flags, "--metrics-path", str(out)], env=env)
        seen[name] = read_metrics(out)[-1]["zenflow/accumulate_on_device"]
    assert seen == {"room": 1.0, "full": 0.0}
