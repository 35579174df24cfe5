"""The machine the plan sizes for: measured (with the knobs) or stated."""

from __future__ import annotations

import types

import pytest

from megatron_ext.config import parse_config
from megatron_ext.memory import machine as machine_mod
from megatron_ext.memory.machine import (
    GB,
    default_tflops,
    measure,
    parse_target_path,
    split_path_spec,
    target_machine,
)
from megatron_ext.offload.paths import parse_tier_spec

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--lr", "1e-3", "--train-iters", "2", "--mock-data", "--vocab-size", "100",
        "--use-distributed-optimizer"]
CPU = types.SimpleNamespace(is_cpu=True, world_size=1, device=None)


@pytest.mark.parametrize("text", ["/nvme", "/nvme@2", "/nvme@2.5,1.25", "/scratch/u@site/run",
                                  "/scratch/u@site/@3,1"])
def test_path_specs_split_as_the_offload_config_parses_them(text):
    spec = parse_tier_spec(text)
    assert split_path_spec(text) == (spec.path, spec.read_gbps, spec.write_gbps)


def test_target_paths():
    assert parse_target_path("60@1.37,1.80", 0) == machine_mod.PathCapacity(
        "path0", 60 * 10**9, 1.37, 1.80)
    assert parse_target_path("7.5@2", 1).write_gbps == 2.0
    assert parse_target_path("100", 2).read_gbps is None
    for bad in ("0", "-1@1,1", "60@1,1,1", "x"):
        with pytest.raises(ValueError):
            parse_target_path(bad, 0)


def test_target_machine_shares_the_node():
    m = target_machine(150.1, 134.2, ["60@1,1", "30@2,2"], 590.0, gpus_per_node=4)
    assert m.gpu_free_bytes == int(150.1 * GB)
    assert m.host_share() == int(134.2 * GB) // 4
    assert m.path_share(1) == 30 * 10**9 // 4




def test_measure_uses_the_knobs(monkeypatch, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.setenv("MEGATRON_EXT_GPU_FREE_GB", "80")
    monkeypatch.setenv("MEGATRON_EXT_MEMAVAILABLE_GB", "64")
    monkeypatch.setenv("MEGATRON_EXT_PATH_FREE_GB", "10,20")
    cfg = parse_config([*TINY, "--offload-optimizer", "--offload-paths",
                        f"{tmp_path / 'a'}@3,2", str(tmp_path / "b")])
    m = measure(cfg, CPU, environ={"LOCAL_WORLD_SIZE": "2"})
    assert (m.gpu_free_bytes, m.host_available_bytes) == (80 * 10**9, 64 * 10**9)
    assert [p.free_bytes for p in m.paths] == [10 * 10**9, 20 * 10**9]
    assert (m.paths[0].read_gbps, m.paths[0].write_gbps, m.paths[1].read_gbps) == (3, 2, None)
    assert m.ranks_per_node == 2 and m.tflops is None


def test_measure_reads_the_machine_without_knobs(tmp_path):
    cfg = parse_config([*TINY, "--offload-optimizer", "--offload-paths", str(tmp_path)])
    m = measure(cfg, CPU, environ={})
    assert m.gpu_free_bytes is None and m.host_available_bytes > 0
    assert m.paths[0].free_bytes > 0 and m.ranks_per_node == 1


def test_tflops_default_is_the_measured_h200_figure():
    assert default_tflops("NVIDIA H200") == 590.0
    assert default_tflops("NVIDIA A100-SXM4-80GB") is None
    cfg = parse_config([*TINY, "--plan-tflops", "123"])
    assert measure(cfg, CPU, environ={}).tflops == 123


def test_expandable_segments_unless_the_job_sets_the_allocator_otherwise():
    from megatron_ext.memory.machine import expandable_segments

    assert expandable_segments({})  # the run sets them (runtime.distributed)
    assert expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert expandable_segments({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:true"})
    assert not expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"})
    assert not expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": ""})
