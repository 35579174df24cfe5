"""--offload-optimizer on a real GPU: pinned buffers, copy streams, events (run on the lent
H200 machine; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.memory.plan import GPU_PROCESS_HOST
from mext_testing import (
    BF16,
    GPU_TINY,
    losses_of,
    read_metrics,
    run_pretrain,
    straight_and_resumed,
    train_losses,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run tests/gpu on the GPU machine)")

BASE = [*GPU_TINY, *BF16, "--use-distributed-optimizer", "--train-iters", "20",
        "--hidden-dropout", "0", "--attention-dropout", "0"]
SMALL = ["--offload-subgroup-size", "10000", "--offload-host-cache-gb", "0.00036"]
# The device tier is auto by default (it was 0): the tests of host-side updates turn it off.
NO_DEVICE = ["--offload-device-cache-gb", "0"]


def tier_flags(tmp_path, count=2):
    dirs = []
    for i in range(count):
        (tmp_path / f"tier{i}").mkdir(exist_ok=True)
        dirs.append(f"{tmp_path / f'tier{i}'}@{2 - i},1")
    return ["--offload-paths", *dirs, *SMALL]


@pytest.mark.parametrize("layout", ["host-only", "two-paths", "two-paths-all-off"])
def test_offload_on_cuda_follows_the_gpu_optimizer(tmp_path, layout):
    """CPU Adam (fused) vs megatron-core's GPU AdamW: the same curve within rounding."""
    flags = [] if layout == "host-only" else tier_flags(tmp_path)
    if layout.endswith("all-off"):
        flags += ["--no-offload-alternate-order", "--no-offload-delayed-grad-conversion",
                  "--no-offload-concurrency-control", "--no-offload-rebalance"]
    plain, offload = tmp_path / "plain.jsonl", tmp_path / "offload.jsonl"
    run_pretrain([*BASE, "--metrics-path", str(plain)])
    # CPU Adam for every subgroup (the streamed update's two device slots would outweigh
    # this tiny model's states on the GPU; it has its own tests below).
    run_pretrain([*BASE, "--offload-optimizer", *flags, *NO_DEVICE, "--no-offload-gpu-update",
                  "--metrics-path", str(offload)])
    assert train_losses(offload) == pytest.approx(train_losses(plain), rel=2e-3)
    last = [r for r in read_metrics(offload) if "offload/cache_hit_rate" in r][-1]
    assert last["offload/device_state_gib"] == 0
    assert last["memory/gpu_max_allocated_gib"] < \
        [r for r in read_metrics(plain) if "lm_loss" in r][-1]["memory/gpu_max_allocated_gib"]


def test_offload_resume_on_cuda(tmp_path):
    # Every subgroup by CPU Adam: with the streamed update the CPU/GPU split follows the
    # measured throughputs, and the two Adams round differently, so a resumed run is equal
    # only to rounding (test_streamed_share_follows_measured_rates_on_cuda).
    flags = [*BASE, "--offload-optimizer", *tier_flags(tmp_path), "--offload-direct-io",
             *NO_DEVICE, "--no-offload-gpu-update"]
    straight, resumed = straight_and_resumed(tmp_path, flags, stop_at=10)
    assert losses_of(resumed) == pytest.approx(losses_of(straight), rel=1e-4)


# ---------------------------------------------------------------- the hierarchy of tiers
# 12 subgroups of 10k elements (120 KB of fp32 state each); 0.0005 GB holds 4 of them.


@pytest.mark.parametrize("layout", ["device-only", "device+host-streamed",
                                    "all-tiers-streamed", "all-tiers-no-gpu-update"])
def test_state_tiers_on_cuda_follow_the_cpu_update(tmp_path, layout):
    """The device tier's fused Adam and the streamed update against CPU Adam (the same
    run with the states in host memory): the same curve within rounding; the device
    tier's states really on the GPU; the streamed share really streamed."""
    if layout == "device-only":
        flags = ["--offload-subgroup-size", "10000", "--offload-device-cache-gb", "1"]
    elif layout == "device+host-streamed":
        # 450 kB: four 10000-element subgroups of 10 B/element (bf16: masters as remainders)
        flags = ["--offload-subgroup-size", "10000", "--offload-device-cache-gb", "0.00045"]
    else:
        flags = [*tier_flags(tmp_path), "--offload-device-cache-gb", "0.00045"]
    if layout.endswith("no-gpu-update"):
        flags.append("--no-offload-gpu-update")
    cpu, tiered = tmp_path / "cpu.jsonl", tmp_path / "tiered.jsonl"
    run_pretrain([*BASE, "--offload-optimizer", "--offload-subgroup-size", "10000",
                  *NO_DEVICE, "--no-offload-gpu-update", "--metrics-path", str(cpu)])
    run_pretrain([*BASE, "--offload-optimizer", *flags, "--metrics-path", str(tiered)],
                 env={"MEGATRON_EXT_OFFLOAD_STREAM_SHARE": "0.5"}
                 if layout.endswith("streamed") else None)
    assert train_losses(tiered) == pytest.approx(train_losses(cpu), rel=2e-3)
    records = [r for r in read_metrics(tiered) if "offload/cache_hit_rate" in r]
    last = records[-1]
    assert last["offload/device_subgroups_n"] == (12 if layout == "device-only" else 4)
    assert last["offload/device_tier_gib"] * 2**30 >= 4 * 100_000  # 10 B/element
    assert (last["offload/streamed_subgroups"] > 0) == layout.endswith("streamed")
    # The device tier's states are CUDA tensors, all of them.
    assert last["offload/device_tier_cuda_gib"] == pytest.approx(last["offload/device_tier_gib"])


def test_streamed_share_follows_measured_rates_on_cuda(tmp_path):
    """Without the test hook the split comes from the measured throughputs: some host
    subgroups go each way (both sides have a rate), and the losses follow CPU Adam."""
    cpu, tiered = tmp_path / "cpu.jsonl", tmp_path / "tiered.jsonl"
    run_pretrain([*BASE, "--offload-optimizer", "--offload-subgroup-size", "10000",
                  *NO_DEVICE, "--no-offload-gpu-update", "--metrics-path", str(cpu)])
    run_pretrain([*BASE, "--offload-optimizer", "--offload-subgroup-size", "10000",
                  *NO_DEVICE, "--metrics-path", str(tiered)])
    assert train_losses(tiered) == pytest.approx(train_losses(cpu), rel=2e-3)
    records = [r for r in read_metrics(tiered) if "offload/cache_hit_rate" in r]
    assert any(r["offload/streamed_subgroups"] > 0 for r in records)


def test_auto_device_tier_on_cuda(tmp_path):
    """auto sizes the device tier from the measured peak: the whole tiny state fits."""
    out = tmp_path / "auto.jsonl"
    result = run_pretrain([*BASE, "--offload-optimizer", "--offload-subgroup-size", "10000",
                           "--offload-device-cache-gb", "auto", "--metrics-path", str(out)])
    assert "device tier (auto): 12 of 12 subgroups" in result.stdout
    last = [r for r in read_metrics(out) if "offload/cache_hit_rate" in r][-1]
    assert last["offload/device_subgroups_n"] == 12


def test_every_size_auto_on_cuda(tmp_path):
    """--offload-optimizer alone: the host cache from MemAvailable (injected here), the
    paths from their free space, the device tier from the memory plan's budget before the
    first step (the whole tiny state fits on the GPU); the curve follows the GPU optimizer."""
    plain, auto = tmp_path / "plain.jsonl", tmp_path / "auto.jsonl"
    run_pretrain([*BASE, "--metrics-path", str(plain)])
    dirs = []
    for i in range(2):
        (tmp_path / f"tier{i}").mkdir()
        dirs.append(str(tmp_path / f"tier{i}"))
    pipeline, state = 3 * 4 * 10_000 + 120_000, 120_000
    result = run_pretrain(
        [*BASE, "--offload-optimizer", "--offload-subgroup-size", "10000", "--offload-paths",
         *dirs, "--offload-host-reserve-gb", "0", "--metrics-path", str(auto)],
        # Beside the process's own start-up, which the plan counts (GPU_PROCESS_HOST).
        env={"MEGATRON_EXT_MEMAVAILABLE_GB": str((GPU_PROCESS_HOST + pipeline + 6 * state)
                                                 / 1e9),
             "LOCAL_WORLD_SIZE": "1"})
    assert train_losses(auto) == pytest.approx(train_losses(plain), rel=2e-3)
    line = next(s for s in result.stdout.splitlines() if "offload: rank 0 tiers:" in s)
    assert "in 12 subgroups (auto: the plan's budget" in line, line
    assert "(auto: MemAvailable" in line, line
    last = [r for r in read_metrics(auto) if "offload/cache_hit_rate" in r][-1]
    assert last["offload/device_subgroups_n"] == 12
    assert last["offload/io_floor_bytes"] == 0 and "offload/roofline_ratio" in last


def test_all_tiers_resume_on_cuda(tmp_path):
    flags = [*BASE, "--offload-optimizer", *tier_flags(tmp_path), "--offload-device-cache-gb",
             "0.0005", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
             "--exp-avg-sq-dtype", "bf16", "--no-offload-gpu-update"]  # see above
    straight, resumed = straight_and_resumed(tmp_path, flags, stop_at=10)
    assert losses_of(resumed) == pytest.approx(losses_of(straight), rel=1e-4)
