"""The memory plan on a real GPU: the measured machine, the estimate against the peak, and a
refusal before the first step (run on the lent H200 machine; skipped elsewhere)."""

from __future__ import annotations

import types

import pytest
import torch

from mext_testing import BF16, GPU_TINY, read_metrics, run_pretrain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run tests/gpu on the GPU machine)")

# Big enough that weights, gradients, states and activations outweigh the CUDA context's
# and cuBLAS's own allocations: 4 layers of hidden 512, sequences of 512, micro-batch 4.
MEDIUM = [*GPU_TINY, *BF16, "--use-distributed-optimizer", "--train-iters", "3",
          "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
          "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "4"]


def test_measure_reads_the_gpu():
    from megatron_ext.config import parse_config
    from megatron_ext.memory.machine import measure

    cfg = parse_config([*GPU_TINY, "--train-iters", "1"])
    runtime = types.SimpleNamespace(is_cpu=False, world_size=1, device=torch.device("cuda", 0))
    machine = measure(cfg, runtime, environ={})
    free, total = torch.cuda.mem_get_info(0)
    assert machine.gpu_total_bytes == total
    assert abs(machine.gpu_free_bytes - free) < 2**30
    assert machine.name == torch.cuda.get_device_name(0)
    if "H200" in machine.name:
        assert machine.tflops == 590.0


def test_plan_against_the_measured_peak(tmp_path):
    metrics = tmp_path / "m.jsonl"
    out = run_pretrain([*MEDIUM, "--metrics-path", str(metrics)]).stdout
    assert "memory plan (plain mode, per rank of 1 on NVIDIA" in out
    records = [r for r in read_metrics(metrics) if "lm_loss" in r]
    plan, peak = records[0], records[-1]["memory/gpu_max_allocated_gib"] * 2**30
    # The CUDA libraries' kernels are outside the allocator, so outside its peak: the plan's
    # tensors and the allocator's slack are what that peak measures (the libraries' share is
    # measured by bench/gpu/plan_vs_peak.py against the driver's count).
    libraries = plan["memory/plan_cuda_libraries_bytes"]
    assert libraries >= 2e9
    tensors = plan["memory/plan_gpu_bytes"] - libraries
    persistent = (tensors - plan["memory/plan_activation_bytes"]
                  - plan["memory/plan_allocator_slack_bytes"])
    print(f"plan: {tensors / 2**30:.3f} GiB in the allocator (activations "
          f"{plan['memory/plan_activation_bytes'] / 2**30:.3f}) and {libraries / 2**30:.2f} "
          f"GiB of CUDA libraries, measured peak {peak / 2**30:.3f} GiB")
    # Weights, gradients and optimizer states are allocated for the whole run.
    assert persistent <= peak
    # The whole estimate is of the peak's order (the activations are an estimate).
    assert 0.5 * peak <= tensors <= 2.0 * peak


def test_a_run_too_big_for_the_gpu_is_refused_before_the_first_step():
    out = run_pretrain(MEDIUM, env={"MEGATRON_EXT_GPU_FREE_GB": "0.05"}, check=False)
    assert out.returncode == 2
    errors = [line for line in out.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: memory plan: the run needs")
    assert "Traceback" not in out.stdout and "building the model" not in out.stdout
