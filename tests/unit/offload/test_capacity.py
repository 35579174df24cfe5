"""The machine's capacities behind the auto sizes: MemAvailable, the node's ranks, each
path's room (injected by knobs, or read from the kernel)."""

from __future__ import annotations

import pytest

from megatron_ext.offload import capacity
from megatron_ext.offload.config import OffloadConfig
from megatron_ext.offload.paths import TierSpec


def test_mem_available_knob_wins(monkeypatch):
    cfg = OffloadConfig(offload_optimizer=True, offload_mem_available_gb=1.5)
    assert capacity.mem_available(cfg) == 1_500_000_000


def test_mem_available_reads_proc_meminfo(monkeypatch, tmp_path):
    monkeypatch.delenv("MEGATRON_EXT_MEMAVAILABLE_GB", raising=False)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:  100 kB\n"
                       "MemAvailable:    8000000 kB\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(
        meminfo if path == "/proc/meminfo" else path, *a, **k))
    assert capacity.mem_available(OffloadConfig(offload_optimizer=True)) == 8_000_000 * 1024
    meminfo.write_text("MemTotal: 1 kB\n")  # an old kernel: unknown
    assert capacity.mem_available(OffloadConfig(offload_optimizer=True)) is None


@pytest.mark.parametrize("env, ranks", [({}, 1), ({"LOCAL_WORLD_SIZE": "4"}, 4),
                                        ({"SLURM_NTASKS_PER_NODE": "2"}, 2),
                                        ({"LOCAL_WORLD_SIZE": "x"}, 1)])
def test_local_ranks(monkeypatch, env, ranks):
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert capacity.local_ranks() == ranks


def test_host_memory_and_its_message():
    cfg = OffloadConfig(offload_optimizer=True, offload_mem_available_gb=100.0,
                        offload_host_reserve_gb=4.0)
    memory = capacity.host_memory(cfg, max_numel=10**8, buffer_bytes=12 * 10**8, ranks=2)
    assert memory.reserve == 4 * 10**9 and memory.pipeline == 24 * 10**8
    assert memory.budget == 48 * 10**9 - 24 * 10**8
    assert str(memory) == ("MemAvailable 100.00 GB less a reserve of 4.00 GB "
                           "(--offload-host-reserve-gb), over 2 ranks of the node, less the "
                           "pipeline's 2.40 GB: 45.60 GB")
    default = capacity.host_memory(OffloadConfig(offload_optimizer=True,
                                                 offload_mem_available_gb=100.0), 0, 0, 1)
    assert default.reserve == 10 * 10**9  # a tenth


def test_path_rooms_knob_or_statvfs(tmp_path):
    tiers = [TierSpec(str(tmp_path), 1.0, 1.0), TierSpec(str(tmp_path / "b"), 1.0, 1.0)]
    (tmp_path / "b").mkdir()
    cfg = OffloadConfig(offload_optimizer=True, offload_paths=[t.path for t in tiers],
                        offload_path_free_gb=[1e-6, 2e-6])
    # Free space / 2 ranks, less three files of 100 bytes (two spares and a temporary one).
    assert capacity.path_rooms(cfg, tiers, 100, 2, lambda p, n: 0) == [200, 700]
    measured = capacity.path_rooms(OffloadConfig(offload_optimizer=True,
                                                 offload_paths=[t.path for t in tiers]),
                                   tiers, 100, 1, lambda p, n: 5000)
    assert measured == [4700, 4700]
