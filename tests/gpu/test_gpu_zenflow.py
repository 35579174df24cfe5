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
    assert all(r["zenflow/d2h_bytes"] > 0 for r in records)
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
