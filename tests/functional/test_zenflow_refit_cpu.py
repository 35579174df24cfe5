"""--zenflow without --offload-optimizer on a host too small for its CPU-side states in memory.

With ``--zenflow-cpu-states auto`` the memory plan moves the CPU side's states to the offload
engine's host cache (``ZenFlowMode.refit``, ``memory/startup.py::settle_plan``) when host
memory refuses them (12 B per delayed element, and whole fp32 copies of the shard during a
re-selection) but the cache fits (10 B per element with bf16 remainders, a pipeline and a
re-selection of a few subgroups). The tiny GPT's host is injected (MemAvailable 4 MB) and the
engine's subgroups made small (its pipeline buffers are per subgroup: a default subgroup
holds all 105k delayed elements, and its buffers alone would cost more than the move saves).
"""

from __future__ import annotations

import pytest

from megatron_ext.config import parse_config
from megatron_ext.memory.machine import Machine
from megatron_ext.memory.plan import plan_run
from mext_testing import BF16, TINY, TINY_VOCAB_IDS, losses_of, read_metrics, run_pretrain

ITERS = 20
# Windows of 4 steps, re-selections at 12 and 20 (interval 8 from step 1, at window ends).
FLAGS = [*TINY, "--train-iters", str(ITERS), "--use-distributed-optimizer", *BF16,
         "--zenflow", "--zenflow-select-interval", "8"]
SUBGROUP = "6600"


def _on_the_host() -> int:
    """What the plan counts for the device (weights, gradients, activations, the selected
    columns' states), which a CPU run keeps in host memory too (MemoryPlan.host_view)."""
    cfg = parse_config(FLAGS)
    cfg.check_world(1)
    cpu = Machine(name="cpu", gpu_total_bytes=None, gpu_free_bytes=None,
                  host_available_bytes=10**12)
    return plan_run(cfg, TINY_VOCAB_IDS + 1, 1, cpu).gpu.used


# The plan's host: the model's part, then 4 MB less the node's tenth. Host states need
# 3.89 MB there, the engine's host cache 3.16 MB (the tiny model's numbers, in the table).
HOST = {"MEGATRON_EXT_MEMAVAILABLE_GB": str(0.004 + _on_the_host() / 1e9)}
REFIT = {**HOST, "MEGATRON_EXT_ZENFLOW_CACHE_SUBGROUP_SIZE": SUBGROUP}
# The same engine asked for by its flags: the states in the tiers, subgroups of the same
# size, the cache sized by the same MemAvailable, no paths.
EXPLICIT = ["--offload-optimizer", "--offload-subgroup-size", SUBGROUP]
NOTE = "zenflow: the CPU side's states (0.00126 GB in host memory) leave too little host memory"


@pytest.fixture(scope="module")
def refit(run_cache):
    """The run that takes the move (once a session)."""
    return run_cache.run(FLAGS, env=REFIT)


def test_the_plan_moves_host_states_to_the_host_cache(refit):
    """The note, the plan's table with the cache's states, and the engine really ran."""
    out = refit.stdout
    assert NOTE in out, out[-4000:]
    table = out[out.index("memory plan ("):out.index("start-up:")]
    assert "10 B/element states in subgroups" in table and "fits" in table
    assert "optimizer states 0.00106" in table and "ZenFlow CPU states" not in table
    assert "offload: optimizer states of 105536 elements per rank in 16 subgroups" in out
    records = [r for r in refit.records if "lm_loss" in r]
    assert len(records) == ITERS
    # Every subgroup in the cache without a file; the updates (windows end at 4, 8, ...)
    # ran in the engine, and it wrote nothing to a disk.
    assert all(r["offload/host_only_subgroups"] == 16 for r in records)
    assert all(r["offload/state_bytes_per_element"] == 10 for r in records)
    # (The update time lands in the records of the steps that the CPU worker finishes a
    # window in, which vary with the machine's load: a sum, not a count per window.)
    assert sum(r["offload/update_s"] for r in records) > 0
    assert sum(r.get("offload/io_bytes", 0) for r in records) == 0
    assert any(0.0 <= r["zenflow/retention"] <= 1.0 for r in records)  # re-selected


def test_without_the_move_the_plan_refuses(tmp_path):
    """The same host without the move (states in host memory asked for): refused."""
    result = run_pretrain([*FLAGS, "--zenflow-cpu-states", "host"], env=REFIT, check=False)
    assert result.returncode == 2, result.stdout[-3000:]
    needs = (3.89e6 + _on_the_host()) / 1e9
    assert f"error: memory plan: the run needs {needs:.3g} GB of host memory" in result.stdout


def test_losses_equal_the_explicit_offload_run_and_host_memory(run_cache, refit):
    """Bit for bit the run that asks for the same engine by --offload-optimizer (the same
    config of it: both build ``TieredCpuStates`` over ``OffloadEngine`` with subgroups of
    6600, an auto cache of the same MemAvailable, no paths), and the run with the states in
    host memory on a host with room (the tiers and the host give the same states bit for
    bit: cpu_states.py; both CPU Adams are the reference implementation on a CPU run)."""
    explicit = run_cache.run([*FLAGS, *EXPLICIT], env=HOST)
    assert NOTE not in explicit.stdout
    memory = run_cache.run(FLAGS)
    assert "ZenFlow CPU states" in memory.stdout
    assert losses_of(refit.records) == losses_of(explicit.records)
    assert losses_of(refit.records) == losses_of(memory.records)


def test_saves_and_resumes_exactly(tmp_path, refit):
    """Stopped at 14 (after the re-selection of 12, which filled a second engine; with a
    window's update pending) and resumed: the resumed run moves its states again and
    continues the same curve."""
    ckpt = tmp_path / "ckpt"
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    run_pretrain([*FLAGS, "--save", str(ckpt), "--exit-interval", "14",
                  "--metrics-path", str(first)], env=REFIT)
    manifest = ckpt / "iter_0000014" / "zenflow" / "offload" / "rank00000" / "manifest.json"
    assert manifest.is_file()
    resumed = run_pretrain([*FLAGS, "--load", str(ckpt), "--metrics-path", str(second)],
                           env=REFIT)
    assert NOTE in resumed.stdout
    records = read_metrics(first) + read_metrics(second)
    assert [r["iteration"] for r in records if "lm_loss" in r] == list(range(1, ITERS + 1))
    assert losses_of(records) == losses_of(refit.records)
