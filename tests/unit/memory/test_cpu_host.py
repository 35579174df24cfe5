"""A CPU run's host holds what the plan counts for the device too; the bound is named.

On a CPU run (no GPU) the weights, gradients and activations are in host memory beside the
optimizer's states: the plan checks them all against the host (``MemoryPlan.host_view``)
and the offload engine's auto cache, sized by the MemAvailable knob, sees what they leave
(``host_knob_after_the_model``). The old plan compared the host's own items alone and said
"fits" for a run three times the host.
"""

from __future__ import annotations

from megatron_ext.config import parse_config
from megatron_ext.memory.machine import GB, Machine
from megatron_ext.memory.plan import plan_run
from megatron_ext.offload.capacity import host_knob_after_the_model

# ~0.15B parameters: ~3 GB on the host of a CPU run (weights, gradients, states).
FLAGS = ["--num-layers", "12", "--hidden-size", "1024", "--num-attention-heads", "8",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "4",
         "--global-batch-size", "4", "--lr", "1e-4", "--train-iters", "2", "--mock-data",
         "--vocab-size", "250"]


def _plan(*more, host_gb=1.4, source="MemAvailable"):
    cfg = parse_config([*FLAGS, *more])
    cfg.check_world(1)
    cpu = Machine(name="cpu", gpu_total_bytes=None, gpu_free_bytes=None,
                  host_available_bytes=int(host_gb * GB), host_source=source)
    return cfg, plan_run(cfg, 251, 1, cpu)


def test_a_cpu_run_counts_the_model_against_the_host():
    _, plan = _plan()
    assert plan.host.used < plan.host.capacity < plan.host_view().used  # the old check: fits
    assert len(plan.refusals) == 1
    line = plan.refusals[0]
    assert line.startswith(f"the run needs {plan.host_view().used / GB:.3g} GB of host memory")
    assert "weights" in line and "gradients" in line and "optimizer states" in line
    _, roomy = _plan(host_gb=10)
    assert not roomy.refusals


def test_the_refusal_names_the_limit_that_bounds_the_host():
    _, plan = _plan(source="ulimit -v")
    assert "1.4 GB available (under ulimit -v): raise the job's address-space limit" \
        in plan.refusals[0]
    _, plan = _plan(source="the memory cgroup /sys/fs/cgroup/memory/slurm/job_7")
    assert ("(under the memory cgroup /sys/fs/cgroup/memory/slurm/job_7): raise the limit of "
            "the memory cgroup /sys/fs/cgroup/memory/slurm/job_7 (Slurm: --mem)") \
        in plan.refusals[0]


def test_the_engine_sizes_its_cache_from_what_the_model_leaves_on_a_cpu_run():
    cfg, plan = _plan("--offload-optimizer", "--use-distributed-optimizer", host_gb=10)
    cfg.offload.offload_mem_available_gb = 10.0
    seen = host_knob_after_the_model(cfg.offload, plan)
    assert seen.offload_mem_available_gb == 10.0 - plan.gpu.used / 1e9
    assert cfg.offload.offload_mem_available_gb == 10.0  # the run's config is left as it is
    cfg.offload.offload_mem_available_gb = None  # measured after the model: nothing to take
    assert host_knob_after_the_model(cfg.offload, plan) is cfg.offload
