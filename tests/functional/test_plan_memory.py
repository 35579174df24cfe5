"""The memory plan end to end: tools/plan_memory.py, refusals before the first step, and the
plan's bytes per tier against what the offload engine then holds (its own metrics)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from mext_testing import ROOT, TINY, read_metrics, run_pretrain, test_env

TOOL = str(ROOT / "tools" / "plan_memory.py")
# The H200 machine of bench/results (139.8 GiB GPU, 125 GiB host) with one 60 GB path at the
# bandwidth its start-up probes measured (bench/results/2026-12-03-h200-redesign/call2:
# the median of the four probes, 1.37 GB/s read, 1.80 GB/s write), at the forward+backward
# TFLOP/s of the 16.5B and 20.1B rows (bench/results/2026-12-02b-h200).
H200 = ["--target-gpu-gb", "150.1", "--target-host-gb", "134.2", "--target-path",
        "60@1.37,1.80", "--target-tflops", "590"]
GPT = ["--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "1",
       "--global-batch-size", "64", "--mock-data", "--vocab-size", "32000", "--bf16",
       "--grad-reduce-in-bf16", "--use-distributed-optimizer", "--lr", "1e-4",
       "--train-iters", "10", "--recompute-granularity", "full", "--recompute-method",
       "uniform", "--recompute-num-layers", "1"]
SHAPES = {
    "12.76B": ["--num-layers", "40", "--hidden-size", "5120", "--num-attention-heads", "40",
               *GPT],
    "16.52B": ["--num-layers", "36", "--hidden-size", "6144", "--num-attention-heads", "48",
               *GPT],
    "20.14B": ["--num-layers", "44", "--hidden-size", "6144", "--num-attention-heads", "48",
               *GPT],
    # Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh, its tokenizer named (files
    # elsewhere: --tokenizer-vocab-size).
    "8.03B": ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
              "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups",
              "8", "--kv-channels", "128", "--seq-length", "8192",
              "--max-position-embeddings", "8192", "--position-embedding-type", "rope",
              "--rotary-base", "1000000", "--swiglu", "--untie-embeddings-and-output-weights",
              "--disable-bias-linear", "--normalization", "RMSNorm", "--attention-backend",
              "fused", "--micro-batch-size", "1", "--global-batch-size", "128", "--bf16",
              "--grad-reduce-in-bf16", "--use-distributed-optimizer", "--lr", "1.5e-4",
              "--train-iters", "10", "--tokenizer-type", "HuggingFaceTokenizer",
              "--tokenizer-model", "meta-llama/Meta-Llama-3-8B", "--data-path",
              "/lustre/llama/text_document", "--save", "/lustre/ckpt/llama3",
              "--recompute-granularity", "full", "--recompute-method", "uniform",
              "--recompute-num-layers", "1", "--tokenizer-vocab-size", "128256"],
}
OFFLOAD = ["--offload-optimizer", "--offload-device-cache-gb", "auto"]


def tool(args):
    return subprocess.run([sys.executable, TOOL, *args], cwd=ROOT, env=test_env(),
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_tool_plans_the_four_shapes_on_the_h200(name):
    start = time.monotonic()
    out = tool([*SHAPES[name], *OFFLOAD, *H200])
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - start < 5
    lines = out.stdout.splitlines()
    assert f"{name} parameters" in lines[0] and "offload mode" in lines[0]
    assert [line.split("|")[0].strip() for line in lines[1:5]] == ["tier", "GPU", "host",
                                                                    "path0"]
    assert "device tier" in lines[2] and "activations" in lines[2]
    assert "step: forward+backward" in out.stdout and "590 TFLOP/s" in out.stdout
    assert lines[-1] == "  fits" and out.stderr == ""


def test_the_tool_refuses_a_plain_run_too_big_for_the_gpu_in_one_line():
    out = tool([*SHAPES["16.52B"], *H200])
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1
    assert out.stderr.startswith("error: memory plan: the run needs 403 GB on the GPU")
    assert out.stderr.strip().endswith("150 GB free: add --offload-optimizer")


def test_the_tool_says_the_refusal_once_and_hints_its_own_tflops_flag():
    out = tool([*SHAPES["16.52B"], *[a for a in H200 if a not in ("--target-tflops", "590")]])
    assert out.returncode == 2
    assert "(no TFLOP/s known: give --target-tflops)" in out.stdout
    assert "--plan-tflops" not in out.stdout + out.stderr
    reason = out.stderr.strip().removeprefix("error: memory plan: ")
    assert (out.stdout + out.stderr).count(reason) == 1, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1] == "  does not fit (why: the line below)"


def test_the_tool_needs_a_target_and_matching_paths():
    out = tool(SHAPES["12.76B"])
    assert out.returncode == 2 and out.stderr.startswith("error: give the target machine")
    out = tool([*SHAPES["12.76B"], *OFFLOAD, "--offload-paths", "/nvme/a", "/nvme/b", *H200])
    assert out.returncode == 2 and "--offload-paths names 2 directories" in out.stderr


BASE = [*TINY, "--train-iters", "2", "--use-distributed-optimizer"]


@pytest.mark.parametrize("flags, env, fragment", [
    ([], {"MEGATRON_EXT_GPU_FREE_GB": "0.003"}, "GB free: add --offload-optimizer"),
    (["--zenflow", "--zenflow-accumulate", "host"], {"MEGATRON_EXT_MEMAVAILABLE_GB": "0.001"},
     "add --offload-optimizer --offload-paths DIR"),
    (["--offload-optimizer", "--offload-subgroup-size", "10000", "--offload-host-cache-gb",
      "0.00036", "--offload-paths", "{tmp}"], {"MEGATRON_EXT_PATH_FREE_GB": "0.0005"},
     "GB more: add --offload-paths DIR with that much free"),
], ids=["plain-gpu", "zenflow-host", "offload-all-tiers"])
def test_a_run_that_cannot_fit_is_refused_before_the_first_step(tmp_path, flags, env, fragment):
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    start = time.monotonic()
    out = run_pretrain([*BASE, *flags], env=env, check=False, timeout=120)
    assert out.returncode == 2, out.stdout[-3000:]
    errors = [line for line in out.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: memory plan: "), out.stdout[-3000:]
    assert fragment in errors[0]
    # The table before it does not say the reason again.
    assert out.stdout.count(errors[0].removeprefix("error: memory plan: ")) == 1
    assert "Traceback" not in out.stdout
    # Before the datasets and the model are built, let alone a step.
    assert "building the datasets" not in out.stdout and "iteration" not in out.stdout
    assert time.monotonic() - start < 60


def test_the_plans_bytes_per_tier_are_what_the_engine_holds(tmp_path):
    """A tiny offload run on every tier: the device tier (host memory on a CPU run, a fixed
    size), a host cache of 3 subgroups, two paths of different speeds. The plan is the
    placement at start; without --no-offload-rebalance the engine would move subgroups
    between the paths as it observes their speeds (on a loaded CI machine, any time)."""
    paths = []
    for i in range(2):
        (tmp_path / f"tier{i}").mkdir()
        paths.append(f"{tmp_path / f'tier{i}'}@{2 if i == 0 else 1},1")
    metrics = tmp_path / "m.jsonl"
    run_pretrain([*BASE, "--train-iters", "3", "--offload-optimizer", "--offload-paths", *paths,
                  "--offload-subgroup-size", "10000", "--offload-host-cache-gb", "0.00036",
                  "--offload-device-cache-gb", "0.00025", "--no-offload-rebalance",
                  "--metrics-path", str(metrics)])
    records = [r for r in read_metrics(metrics) if "lm_loss" in r]
    plan = records[0]
    assert plan["memory/plan_fits"] == 1.0
    assert plan["memory/plan_state_bytes_per_element"] == 12  # fp32 weights: no remainder
    for engine in records:
        assert engine["offload/device_subgroups_n"] == plan["memory/plan_device_subgroups"] == 2
        assert engine["offload/device_tier_gib"] * 2**30 == pytest.approx(
            plan["memory/plan_device_tier_bytes"])
        assert engine["offload/host_cache_gib"] * 2**30 == pytest.approx(
            plan["memory/plan_host_cache_bytes"])
        for i in range(2):
            assert engine[f"offload/path{i}_subgroups"] == plan[f"memory/plan_path{i}_subgroups"]
    assert plan["memory/plan_path0_subgroups"] > plan["memory/plan_path1_subgroups"] > 0
    # The disk's bytes of a step once the cache is warm (the last records), within one
    # subgroup (120 KB read + written) of the plan's.
    moved = sum(records[-1][f"offload/path{i}_bytes"] for i in range(2))
    planned = sum(plan[f"memory/plan_path{i}_io_bytes"] for i in range(2))
    assert abs(moved - planned) <= 2 * 120_000
