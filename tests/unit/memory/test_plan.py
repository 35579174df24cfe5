"""The memory plan: placement per tier, the device budget, the one-line refusals."""

from __future__ import annotations

import logging
import types

import pytest

from megatron_ext.config import parse_config
from megatron_ext.errors import UsageError
from megatron_ext.memory.machine import GB, Machine, PathCapacity, target_machine
from megatron_ext.memory.plan import device_budget_bytes, make_plan, plan_run
from megatron_ext.memory.shape import model_shape
from megatron_ext.memory.startup import plan_before_start

# The 16.5B row on one H200 (bench/gpu/gpu_offload_large.sh's flags).
BIG = ["--num-layers", "36", "--hidden-size", "6144", "--num-attention-heads", "48",
       "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "1",
       "--global-batch-size", "64", "--lr", "1e-4", "--train-iters", "10", "--mock-data",
       "--vocab-size", "32000", "--bf16", "--grad-reduce-in-bf16",
       "--use-distributed-optimizer", "--recompute-granularity", "full", "--recompute-method",
       "uniform", "--recompute-num-layers", "1"]
# The 6.6B of docs/zenflow.md (32 layers, hidden 4096).
MID = [a for a in BIG]
MID[1], MID[3], MID[5] = "32", "4096", "32"
H200 = dict(gpu_gb=150.1, host_gb=134.2, tflops=590.0)


def plan(flags, paths=(), offload_paths=None, **machine):
    cfg = parse_config(flags)
    cfg.check_world(1)
    if offload_paths is not None:
        cfg.offload.offload_paths = offload_paths
    spec = {**H200, **machine}
    return plan_run(cfg, 32001, 1, target_machine(spec["gpu_gb"], spec["host_gb"], list(paths),
                                                  spec["tflops"]))


def one_line(text):
    assert "\n" not in text
    return text


def test_plain_run_too_big_for_the_gpu_names_offload_optimizer():
    p = plan(BIG)
    assert len(p.refusals) == 1
    line = one_line(p.refusals[0])
    assert line.startswith("the run needs 403 GB on the GPU (weights 33.0, gradients 33.0, "
                           "activations 2.07, optimizer states 198, optimizer step beyond the "
                           "activations 130, allocator slack 3.96, CUDA libraries 2.6), 150 GB "
                           "free")
    assert line.endswith(": add --offload-optimizer")


def test_plain_run_without_distributed_optimizer_names_both_flags():
    flags = [f for f in BIG if f != "--use-distributed-optimizer"]
    assert plan(flags).refusals[0].endswith(
        ": add --use-distributed-optimizer --offload-optimizer")


def test_a_model_that_does_not_fit_even_without_states_names_parallelism():
    line = one_line(plan(BIG, gpu_gb=40).refusals[0])
    assert "--tensor-model-parallel-size" in line and "--offload-optimizer" not in line


def test_plain_run_that_fits():
    small = [a if a not in ("36",) else "4" for a in BIG]  # 4 layers: 2.3B parameters
    p = plan(small)
    assert not p.refusals
    assert p.gpu.used < p.gpu.capacity


def test_offload_places_device_tier_host_cache_and_path():
    flags = [*BIG, "--offload-optimizer", "--offload-device-cache-gb", "auto"]
    p = plan(flags, paths=["60@1.37,1.80"], offload_paths=["/nvme"])
    assert not p.refusals
    shape = p.shape
    # Free GPU memory less weights, gradients, activations, staging, the allocator's slack
    # (1 % of them: expandable segments), the CUDA libraries' 2.6 GB and the 4 GB reserve.
    staging = p.gpu.items["offload staging"]
    items = shape.weights_bytes + shape.grads_bytes + shape.activation_bytes + staging
    assert p.gpu.items["allocator slack"] == int(0.01 * items)
    assert p.gpu.items["CUDA libraries"] == int(2.6 * GB)
    assert device_budget_bytes(p) == (int(150.1 * GB) - items - int(0.01 * items)
                                      - int(2.6 * GB) - 4 * 10**9)
    sub = p.subgroup_bytes
    assert sub == 10**8 * 10  # 10 B/element: the master as a remainder beside bf16
    assert p.device_subgroups == device_budget_bytes(p) // sub
    # Every subgroup is somewhere: the device tier, the host cache only, or a path.
    placed = p.device_subgroups + p.host_subgroups + sum(t.subgroups for t in p.paths)
    assert placed == -(-shape.shard_elements // 10**8)
    assert p.paths[0].used <= 60 * GB - 3 * sub  # the path keeps room for its spares
    assert p.fwd_bwd_s == pytest.approx(shape.flops_per_iteration / 590e12)
    assert p.io_floor_s == pytest.approx(p.paths[0].read_bytes / 1.37e9
                                         + p.paths[0].write_bytes / 1.80e9)
    assert p.step_s == pytest.approx(p.fwd_bwd_s + p.io_floor_s)


def test_offload_states_beyond_gpu_host_and_paths_say_how_much_more():
    flags = [*BIG, "--offload-optimizer", "--offload-device-cache-gb", "0"]  # no device tier
    p = plan(flags, paths=["20@1,1"], offload_paths=["/nvme"])
    line = one_line(p.refusals[0])
    assert line.startswith("the optimizer states need 165 GB: the GPU's device tier holds 0, "
                           "the host 116 and the paths 17.0")
    assert "GB more: add --offload-paths DIR with that much free" in line


def test_offload_without_paths_and_too_little_host_names_offload_paths():
    line = one_line(plan([*BIG, "--offload-optimizer", "--offload-device-cache-gb", "0"])
                    .refusals[0])
    # (the engine's own pipeline bytes and reserve: offload/tier_model.py, capacity.py)
    assert line.endswith("; 50.0 GB more: add --offload-paths DIR with 50.0 GB free")


def test_offload_host_cache_too_small_for_the_pipeline():
    flags = [*BIG, "--offload-optimizer", "--offload-host-cache-gb", "2"]
    line = one_line(plan(flags, paths=["600@1,1"], offload_paths=["/nvme"]).refusals[0])
    assert line == ("--offload-host-cache-gb 2 holds 2 subgroups of 1 GB; the pipeline needs 3: "
                    "give at least 3 GB or a smaller --offload-subgroup-size")


def test_no_host_cache_needs_paths():
    flags = [*BIG, "--offload-optimizer", "--offload-host-cache-gb", "0"]
    line = one_line(plan(flags).refusals[0])
    assert line.startswith("--offload-host-cache-gb 0 keeps none of the optimizer states (")
    assert line.endswith("GB) in host memory and there is no --offload-paths for them: give "
                         "--offload-paths DIR, or a positive --offload-host-cache-gb (or auto)")
    p = plan(flags, paths=["600@1,1"], offload_paths=["/nvme"])
    assert p.refusals == []
    # The pipeline's three buffers of 1 GB in host memory, every other state on the path.
    assert p.host.subgroups == 3 and p.host_subgroups == 0
    assert p.host_cache_bytes == 3 * p.subgroup_bytes
    # The same as the pipeline's minimum given as a size: 95 on the path, 71 on the GPU.
    three = plan([*BIG, "--offload-optimizer", "--offload-host-cache-gb", "3"],
                 paths=["600@1,1"], offload_paths=["/nvme"])
    assert (p.paths[0].subgroups, p.device_subgroups) == (three.paths[0].subgroups,
                                                          three.device_subgroups) == (95, 71)


def test_zenflow_cpu_states_too_big_for_the_host_name_offload_paths():
    p = plan([*MID, "--zenflow", "--zenflow-accumulate", "host"])
    assert p.mode == "zenflow"
    line = one_line(p.refusals[0])
    assert "GB of host memory per rank" in line and "ZenFlow CPU states" in line
    assert line.endswith("add --offload-optimizer --offload-paths DIR (ZenFlow then keeps its "
                         "CPU-side states in the offload tiers)")


def test_zenflow_with_paths_keeps_its_cpu_states_in_the_tiers():
    p = plan([*MID, "--zenflow", "--offload-optimizer", "--zenflow-accumulate", "host"],
             paths=["60@1.37,1.80"], offload_paths=["/nvme"], host_gb=123)
    assert not p.refusals
    assert "ZenFlow CPU states" not in p.host.items
    assert p.paths[0].subgroups > 0
    # The CPU side updates once per window of 4 iterations, beside forward and backward.
    assert p.step_s == pytest.approx(max(p.fwd_bwd_s, p.io_floor_s))


def test_zenflow_explicit_host_states_name_the_tiers_flag():
    p = plan([*MID, "--zenflow", "--offload-optimizer", "--zenflow-cpu-states", "host",
              "--zenflow-accumulate", "host"])
    assert p.refusals[0].endswith("use --zenflow-cpu-states tiers with --offload-paths DIR")


def test_no_gpu_known_checks_no_gpu():
    cfg = parse_config(BIG)
    cfg.check_world(1)
    shape = model_shape(cfg, 32001, 1)
    p = make_plan(cfg, shape, Machine("cpu", None, None, 10**12))
    assert not p.refusals and device_budget_bytes(p) == 0


def _runtime():
    return types.SimpleNamespace(is_cpu=True, world_size=1, device=None)


def test_start_up_refuses_in_one_line(monkeypatch):
    monkeypatch.setenv("MEGATRON_EXT_GPU_FREE_GB", "100")
    cfg = parse_config(BIG)
    cfg.check_world(1)
    with pytest.raises(UsageError) as err:
        plan_before_start(cfg, _runtime(), 32001)
    assert one_line(str(err.value)).startswith("memory plan: the run needs 403 GB on the GPU")


def test_no_plan_check_logs_the_refusal_and_goes_on(monkeypatch, caplog):
    monkeypatch.setenv("MEGATRON_EXT_GPU_FREE_GB", "100")
    cfg = parse_config([*BIG, "--no-plan-check"])
    cfg.check_world(1)
    with caplog.at_level(logging.INFO, logger="megatron_ext"):
        p = plan_before_start(cfg, _runtime(), 32001)
    assert p.refusals
    assert "memory plan (plain mode" in caplog.text
    assert "--no-plan-check: starting anyway" in caplog.text


def test_paths_shared_by_the_ranks_of_a_node():
    machine = Machine("m", 10**11, 10**11, 8 * 10**11, ranks_per_node=8,
                      paths=(PathCapacity("/nvme", 8 * 10**12, 2.0, 2.0),))
    assert machine.host_share() == 10**11 and machine.path_share(0) == 10**12


# Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh as it runs (no recomputation,
# fp8 left out), global batch 128 of 8192.
LLAMA = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
         "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
         "--kv-channels", "128", "--seq-length", "8192", "--max-position-embeddings", "8192",
         "--position-embedding-type", "rope", "--swiglu",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--micro-batch-size", "1", "--global-batch-size", "128", "--bf16",
         "--grad-reduce-in-bf16", "--use-distributed-optimizer", "--lr", "1.5e-4",
         "--train-iters", "10", "--mock-data", "--vocab-size", "128256", "--zenflow"]


def settled(flags, host_gb):
    from megatron_ext.memory.startup import settle_plan

    cfg = parse_config(flags)
    cfg.check_world(1)
    p, note = settle_plan(cfg, 128256, 1, target_machine(150.1, host_gb, [], 590.0))
    return cfg, p, note


def test_zenflow_host_states_keep_the_nodes_reserve_free():
    """Llama-3-8B's ZenFlow needs 196 GB of host memory with its states there (130 GB, and
    64.2 GB while a re-selection moves them through whole fp32 copies of the shard; 2.1 GB
    the process's start-up), over the
    H200's 133.6 GB of MemAvailable with the tenth left for the node (the run of
    2026-12-03 that the OOM killer ended had no such margin)."""
    cfg = parse_config(LLAMA)
    cfg.check_world(1)
    p = plan_run(cfg, 128256, 1, target_machine(150.1, 133.6, [], 590.0))
    line = one_line(p.refusals[0])
    assert line.startswith("the run needs 196 GB of host memory per rank")
    assert "ZenFlow CPU states 86.7, ZenFlow re-selection 64.2" in line
    assert "134 GB available less a reserve of 13.4:" in line


def test_zenflow_auto_moves_host_states_that_do_not_fit_to_the_host_cache():
    cfg, p, note = settled(LLAMA, 140.0)
    assert not p.refusals
    assert cfg.zenflow.zenflow_cpu_states == "tiers"
    assert note.startswith("zenflow: the CPU side's states (86.7 GB in host memory)")
    assert "ZenFlow CPU states" not in p.host.items
    # 10 bytes per delayed element (the remainders), all in the cache, nothing on a path.
    assert p.state_bytes_per_element == 10 and not p.paths
    assert p.host.used + 14.0 * GB <= p.host.capacity


def test_zenflow_host_cache_counts_the_reselection_beside_the_states():
    """The H200's 133.6 GB: the host cache's states (73 GB), the window mean and the new
    weights fit (118.6 GB, bench/results/2026-12-03c-h200 call2's plan), but not with what
    a re-selection holds besides (a second engine's pipeline, two subgroups and the weights
    kept under them: 4.6 GB):
    the refit is undone and the refusal names the paths that take the rest."""
    cfg, p, note = settled(LLAMA, 133.6)
    assert note is None and p.refusals
    assert cfg.zenflow.zenflow_cpu_states == "host"
    assert one_line(p.refusals[0]).endswith("add --offload-optimizer --offload-paths DIR "
                                            "(ZenFlow then keeps its CPU-side states in the "
                                            "offload tiers)")
    cfg.zenflow.zenflow_cpu_states = "tiers"
    tiers = plan_run(cfg, 128256, 1, target_machine(150.1, 133.6, [], 590.0))
    assert one_line(tiers.refusals[0]).endswith("6 GB more: add --offload-paths DIR with 6 GB "
                                                "free")
    # the kept weights: two subgroups of bf16 weights (zenflow/kept_weights.py)
    assert tiers.host.items["ZenFlow re-selection"] == 2_200_000_000 + 2 * 10**9 + 4 * 10**8


def test_zenflow_auto_keeps_host_states_where_they_fit():
    cfg, p, note = settled(LLAMA, 250.0)
    assert note is None and not p.refusals
    assert cfg.zenflow.zenflow_cpu_states == "host"
    assert "ZenFlow CPU states" in p.host.items


def test_zenflow_auto_refit_that_does_not_fit_either_is_undone():
    cfg, p, note = settled(LLAMA, 60.0)
    assert note is None
    assert cfg.zenflow.zenflow_cpu_states == "host"
    assert one_line(p.refusals[0]).endswith("add --offload-optimizer --offload-paths DIR "
                                            "(ZenFlow then keeps its CPU-side states in the "
                                            "offload tiers)")


def test_zenflow_explicit_host_states_are_not_moved():
    cfg, p, note = settled([*LLAMA, "--zenflow-cpu-states", "host"], 133.6)
    assert note is None and p.refusals
    assert cfg.zenflow.zenflow_cpu_states == "host"


def test_ddp_buffer_bytes_count_the_parameter_buffer_with_the_distributed_optimizer():
    from megatron_ext.model.build import ddp_buffer_bytes

    params = [torch_param(1000), torch_param(24, grad=False)]
    dist = types.SimpleNamespace(use_distributed_optimizer=True)
    plain = types.SimpleNamespace(use_distributed_optimizer=False)
    assert ddp_buffer_bytes(params, dist, grad_reduce_in_fp32=False) == 1000 * (2 + 2)
    assert ddp_buffer_bytes(params, dist, grad_reduce_in_fp32=True) == 1000 * (4 + 2)
    assert ddp_buffer_bytes(params, plain, grad_reduce_in_fp32=True) == 1000 * 4


def torch_param(n, grad=True):
    import torch

    return torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16), requires_grad=grad)


@pytest.mark.parametrize("reserve", [[], ["--offload-host-reserve-gb", "7"]],
                         ids=["a-tenth", "given"])
def test_the_host_reserve_is_the_engines_rule(reserve):
    """One rule for the node's reserve: the plan's share per rank is the engine's."""
    import dataclasses

    from megatron_ext.memory.plan import _host_reserve
    from megatron_ext.offload import capacity

    cfg = parse_config([*BIG, "--offload-optimizer", *reserve])
    off = dataclasses.replace(cfg.offload, offload_mem_available_gb=134.2)
    engine = capacity.host_memory(off, max_numel=0, buffer_bytes=0, ranks=4)
    assert engine.reserve == (7 * 10**9 if reserve else 13_420_000_000)
    assert _host_reserve(cfg, 134_200_000_000, 4) == engine.reserve // 4


def test_tiered_states_carry_their_modes_placement():
    """The plan places tiered states by the mode's rule only (no copy of it of its own)."""
    from megatron_ext.optim.modes import TieredStates

    with pytest.raises(TypeError, match="place"):
        TieredStates(elements=10, arrays=(4, 4, 4), subgroup_size=5)
    cfg = parse_config([*BIG, "--offload-optimizer", "--offload-placement", "round-robin"])
    cfg.check_world(1)
    from megatron_ext.optim.modes import mode_of

    states = mode_of(cfg).memory_needs(cfg, model_shape(cfg, 32001, 1), None).tiered
    assert states.place([100] * 4, [3.0, 1.0], [10**6, 10**6]) == [0, 1, 0, 1]
    cfg = parse_config([*BIG, "--offload-optimizer"])
    states = mode_of(cfg).memory_needs(cfg, model_shape(cfg, 32001, 1), None).tiered
    # The engine's bandwidth rule: 3:1 in bytes, interleaved.
    assert states.place([100] * 4, [3.0, 1.0], [10**6, 10**6]) == [0, 1, 0, 0]


def test_zenflow_refit_sizes_the_cache_engines_subgroups_by_the_test_hook(monkeypatch):
    """MEGATRON_EXT_ZENFLOW_CACHE_SUBGROUP_SIZE: the moved states' engine takes subgroups of
    that size (the plan and the engine read it from the offload section). Half the default
    halves the pipeline and the re-selection's subgroups: a host of 135.7 GB, where the
    default refit is undone (the test above, with the process's 2.1 GB of start-up beside),
    now fits; an undone refit gives the default back."""
    cfg, p, note = settled(LLAMA, 135.7)
    assert note is None and p.refusals
    monkeypatch.setenv("MEGATRON_EXT_ZENFLOW_CACHE_SUBGROUP_SIZE", "50000000")
    cfg, p, note = settled(LLAMA, 135.7)
    assert note is not None and not p.refusals
    assert cfg.offload.offload_subgroup_size == 50_000_000
    assert p.host.items["ZenFlow re-selection"] == 1_100_000_000 + 2 * 5 * 10**8 + 2 * 10**8
    cfg, p, note = settled(LLAMA, 60.0)
    assert note is None and cfg.zenflow.zenflow_cpu_states == "host"
    assert cfg.offload.offload_subgroup_size == 100_000_000


def test_a_gpu_plan_counts_the_allocators_slack():
    """1 % of the GPU items with expandable segments (the run's default), 15 % with torch's
    default allocator (bench/results/2026-12-07b-h100-plan-vs-peak: 0.35 % and 14.1 %
    measured); the device budget leaves it out."""
    import dataclasses

    from megatron_ext.memory.plan import SLACK_DEFAULT, SLACK_EXPANDABLE

    cfg = parse_config([*MID, "--offload-optimizer"])
    cfg.check_world(1)
    machine = target_machine(150.1, 134.2, [], 590.0)
    shape = model_shape(cfg, 32001, 1)
    grown = make_plan(cfg, shape, machine)
    torch_default = make_plan(cfg, shape, dataclasses.replace(machine,
                                                              expandable_segments=False))
    assert 0 < grown.gpu.items["allocator slack"] < torch_default.gpu.items["allocator slack"]
    for p, share in ((grown, SLACK_EXPANDABLE), (torch_default, SLACK_DEFAULT)):
        others = sum(v for k, v in p.gpu.items.items()
                     if k not in ("allocator slack", "CUDA libraries", "device tier"))
        assert p.gpu.items["allocator slack"] == int(share * others)
    assert torch_default.device_budget == grown.device_budget - (
        torch_default.gpu.items["allocator slack"] - grown.gpu.items["allocator slack"])


def test_a_gpu_run_counts_its_start_up_on_the_host_and_a_cpu_run_none():
    from megatron_ext.memory.plan import GPU_PROCESS_HOST

    cfg = parse_config(MID)
    cfg.check_world(1)
    shape = model_shape(cfg, 32001, 1)
    gpu = make_plan(cfg, shape, target_machine(150.1, 134.2, [], 590.0))
    assert gpu.host.items == {"CUDA libraries and start-up": GPU_PROCESS_HOST}
    assert gpu.host.used == GPU_PROCESS_HOST
    cpu = make_plan(cfg, shape, Machine("cpu", None, None, 10**12))
    assert "CUDA libraries and start-up" not in cpu.host_view().items
    assert "allocator slack" not in cpu.gpu.items


def test_a_gpu_plan_counts_the_cuda_libraries_outside_the_allocator(monkeypatch):
    """The kernels CUDA's libraries load after the plan take GPU memory outside the caching
    allocator (2.06-2.49 GB measured on an H200, bench/results/2026-12-07d-h200-plan-vs-peak):
    the plan counts them, the device budget leaves them out; a CPU run has none."""
    import megatron_ext.memory.plan as plan_module

    cfg = parse_config([*MID, "--offload-optimizer"])
    cfg.check_world(1)
    shape = model_shape(cfg, 32001, 1)
    machine = target_machine(150.1, 134.2, [], 590.0)
    counted = make_plan(cfg, shape, machine)
    assert counted.gpu.items["CUDA libraries"] == plan_module.GPU_LIBRARIES >= 2 * GB
    monkeypatch.setattr(plan_module, "GPU_LIBRARIES", 0)
    without = make_plan(cfg, shape, machine)
    assert counted.device_budget == without.device_budget - int(2.6 * GB)
    assert counted.gpu.used - counted.gpu.items.get("device tier", 0) == (
        without.gpu.used - without.gpu.items.get("device tier", 0) + int(2.6 * GB))
    cpu = make_plan(cfg, shape, Machine("cpu", None, None, 10**12))
    assert "CUDA libraries" not in cpu.gpu.items
