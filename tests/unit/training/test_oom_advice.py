"""The out-of-memory line's advice: a host shortage gets host remedies, by optimizer mode."""

from __future__ import annotations

import pytest

from megatron_ext.config import parse_config
from megatron_ext.optim.modes import mode_of
from megatron_ext.training.oom_advice import oom_advice
from mext_testing import TINY

CPU = [*TINY, "--train-iters", "2"]
GPU = [a if a != "cpu" else "cuda" for a in CPU]  # parsed only: no GPU needed
DIST = ["--use-distributed-optimizer"]
OFFLOAD = [*DIST, "--offload-optimizer"]
ZENFLOW = [*DIST, "--zenflow"]


@pytest.mark.parametrize("flags, mode, tips", [
    # plain on a GPU: its states are on the GPU; what is every run's.
    (GPU, "plain", ["fewer ranks per node"]),
    (GPU + DIST + ["--optimizer-cpu-offload", "--bf16"], "plain",
     ["a lower --optimizer-offload-fraction", "fewer ranks per node"]),
    # plain on the CPU: its states are in host memory; the engine puts them on a disk.
    (CPU, "plain", ["--use-distributed-optimizer --offload-optimizer --offload-paths DIR",
                     "a smaller --micro-batch-size", "fewer ranks per node"]),
    (GPU + OFFLOAD, "offload", ["--offload-paths DIR (a disk for the optimizer states) with a "
                                "smaller --offload-host-cache-gb", "fewer ranks per node"]),
    (GPU + OFFLOAD + ["--offload-paths", "{tmp}"], "offload",
     ["a larger --offload-host-reserve-gb", "--offload-host-cache-gb 0 (every state in a file)"]),
    (GPU + OFFLOAD + ["--offload-paths", "{tmp}", "--offload-host-cache-gb", "4"], "offload",
     ["a smaller --offload-host-cache-gb (0: every state in a file)"]),
    (GPU + OFFLOAD + ["--offload-paths", "{tmp}", "--offload-host-cache-gb", "0"], "offload",
     ["a smaller --offload-subgroup-size"]),
    (GPU + ZENFLOW, "zenflow",
     ["--offload-optimizer --offload-paths DIR (ZenFlow's CPU-side states in the offload "
      "tiers, on a disk)", "--zenflow-accumulate device", "a larger --zenflow-topk-ratio"]),
    (GPU + ZENFLOW + ["--zenflow-accumulate", "device"], "zenflow",
     ["--offload-optimizer --offload-paths DIR", "a larger --zenflow-topk-ratio"]),
    (GPU + ZENFLOW + ["--offload-optimizer", "--offload-paths", "{tmp}"], "zenflow",
     ["--offload-host-cache-gb 0 (every state in a file)", "--zenflow-accumulate device"]),
    (CPU + ZENFLOW, "zenflow", ["--offload-optimizer --offload-paths DIR"]),
], ids=["plain-gpu", "plain-cpu-offload", "plain-cpu", "offload-no-paths", "offload-auto",
        "offload-size", "offload-zero", "zenflow", "zenflow-device-accumulator",
        "zenflow-tiers", "zenflow-cpu"])
def test_host_oom_advice_is_the_modes_host_remedies(tmp_path, flags, mode, tips):
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    cfg = parse_config(flags)
    assert mode_of(cfg).name == mode
    text = oom_advice(cfg, "host")
    assert text.startswith("try "), text
    for tip in tips:
        assert tip in text, (tip, text)
    # Never a GPU-memory remedy for host memory.
    for device_tip in ("--recompute-granularity", "--tensor-model-parallel-size"):
        assert device_tip not in text, text
    if "cuda" in flags:
        assert "--micro-batch-size" not in text, text
    if mode == "zenflow" and "cpu" in flags:
        assert "--zenflow-accumulate device" not in text, text


def test_every_mode_answers_host_memory_fixes():
    from megatron_ext.optim.modes import modes

    cfg = parse_config(CPU)
    for mode in modes():
        assert isinstance(mode.host_memory_fixes(cfg, on_cpu=True), list), mode.name


def test_device_oom_advice_is_unchanged():
    assert oom_advice(parse_config(GPU), "device").startswith("try --offload-optimizer")
