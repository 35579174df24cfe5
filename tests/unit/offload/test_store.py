"""The subgroup store: file round trips, version and checksum checks, spill, fetch/flush."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from megatron_ext.offload.config import OffloadConfig
from megatron_ext.offload.jobdir import JobDirs
from megatron_ext.offload.paths import TierSpec
from megatron_ext.offload.plan import TierPlan
from megatron_ext.offload.state_format import OffloadStateError
from megatron_ext.offload.states import StateLayout
from megatron_ext.offload.store import StepStats, SubgroupStore
from megatron_ext.offload.subgroups import partition
from megatron_ext.runtime.faults import Faults

SIZE = 100
NUMELS = [100, 100, 100, 100, 100, 40]  # six subgroups of SIZE elements, the last one short


def make_store(tmp_path, n_paths=1, cache_subgroups=3, faults=Faults(), numels=NUMELS,
               groups=None, layout=None, **cfg_extra):
    """A CPU store of a shard of ``numels`` over ``n_paths`` directories under ``tmp_path``."""
    tiers = []
    for i in range(n_paths):
        (tmp_path / f"p{i}").mkdir(exist_ok=True)
        tiers.append(TierSpec(str(tmp_path / f"p{i}"), read_gbps=1.0, write_gbps=1.0))
    layout = layout or StateLayout()
    cfg = OffloadConfig(offload_optimizer=True, offload_paths=[t.path for t in tiers],
                        offload_subgroup_size=SIZE,
                        offload_host_cache_gb=(cache_subgroups * layout.nbytes(SIZE) / 1e9
                                               if n_paths else None), **cfg_extra)
    subgroups = partition(numels, groups or [0] * len(numels), SIZE)
    sizes = [layout.nbytes(sg.numel) for sg in subgroups]
    device = torch.device("cpu")
    jobdirs = JobDirs([t.path for t in tiers], "test", 0)
    plan = TierPlan(cfg, [sg.numel for sg in subgroups], sizes, layout.nbytes(SIZE),
                    tiers=tiers, rank=0, device=device)
    return SubgroupStore(cfg, tiers, jobdirs, plan, rank=0, device=device, subgroups=subgroups,
                         layout=layout, stats=StepStats(len(tiers)), faults=faults)


def state(store, index, seed):
    """A host buffer holding a recognizable state of subgroup ``index``."""
    buffer = store.cache.allocate()
    gen = torch.Generator().manual_seed(seed)
    for view in store.views(buffer, index):
        view.copy_(torch.randn(view.numel(), generator=gen))
    return buffer


def test_write_read_round_trip_and_accounting(tmp_path):
    store = make_store(tmp_path, n_paths=2)
    try:
        store.version[1] = 7
        written = state(store, 1, seed=1)
        path = store.write(1, written)
        assert store.location[1] == path == store.plan.home[1]
        back = torch.zeros_like(written)
        store.read(1, back)
        n = store.sizes[1]
        assert torch.equal(back[:n], written[:n])
        assert store.stats.write_bytes[path] == n and store.stats.read_bytes[path] == n
        assert store.stats.write_bytes[1 - path] == 0
    finally:
        store.close()


def test_a_file_of_another_step_is_refused(tmp_path):
    store = make_store(tmp_path)
    try:
        store.version[0] = 3
        store.write(0, state(store, 0, seed=0))
        store.version[0] = 4  # the engine expects a newer state than the file holds
        with pytest.raises(OffloadStateError, match="belongs to step 3, expected 4"):
            store.read(0, store.cache.allocate())
    finally:
        store.close()


def test_checksum_mismatch_is_detected(tmp_path):
    store = make_store(tmp_path)
    try:
        store.write(2, state(store, 2, seed=2))
        name = store.file(2, store.location[2])
        with open(name, "r+b") as f:
            f.seek(4096 + 10)
            byte = f.read(1)
            f.seek(4096 + 10)
            f.write(bytes([byte[0] ^ 1]))
        with pytest.raises(OffloadStateError, match="checksum mismatch"):
            store.read(2, store.cache.allocate())
    finally:
        store.close()


def test_injected_corruption_after_a_flush_is_detected(tmp_path):
    store = make_store(tmp_path, faults=Faults((("corrupt-after-flush", "0"),)))
    try:
        store.write(0, state(store, 0, seed=0))
        with pytest.raises(OffloadStateError, match="checksum mismatch"):
            store.read(0, store.cache.allocate())
    finally:
        store.close()


def test_enospc_spills_the_path_to_another(tmp_path, caplog):
    store = make_store(tmp_path, n_paths=2, faults=Faults((("enospc", "0"),)))
    try:
        index = store.plan.home.index(0)
        moved = [i for i, home in enumerate(store.plan.home) if home == 0]
        written = state(store, index, seed=5)
        with caplog.at_level(logging.WARNING, logger="megatron_ext.offload.store"):
            path = store.write(index, written)
        assert path == 1 and store.location[index] == 1
        assert store.bad_paths == {0}
        assert all(store.plan.home[i] == 1 for i in moved), store.plan.home
        assert any("now go to" in r.message and "No space left" in r.message
                   for r in caplog.records)
        back = torch.zeros_like(written)
        store.read(index, back)
        assert torch.equal(back, written)
    finally:
        store.close()


def test_enospc_on_the_only_path_is_one_clear_error(tmp_path):
    store = make_store(tmp_path, faults=Faults((("enospc", "0"),)))
    try:
        with pytest.raises(OffloadStateError, match="no other --offload-paths has room"):
            store.write(0, state(store, 0, seed=0))
    finally:
        store.close()


def test_fill_evicts_through_the_paths_and_acquire_reads_back(tmp_path):
    """Six subgroups, three buffers: the fill flushes evicted ones, a later acquire fetches."""
    store = make_store(tmp_path, cache_subgroups=3)
    try:
        expected = {}

        def source(index, buffer):
            gen = torch.Generator().manual_seed(index)
            for view in store.views(buffer, index):
                view.copy_(torch.randn(view.numel(), generator=gen))
            expected[index] = buffer[:store.sizes[index]].clone()
        store.fill(source, list(range(6)))
        assert len(store.cache) == 3 and store.cache.allocated == 3
        assert [loc is not None for loc in store.location] == [True] * 3 + [False] * 3
        for index in range(6):
            got = store.acquire(index)[:store.sizes[index]]
            assert torch.equal(got, expected[index]), f"subgroup {index} differs"
        store.wait_io()
        assert sum(store.stats.read_bytes) > 0 and sum(store.stats.write_bytes) > 0
    finally:
        store.close()


def test_trace_lines_name_each_operation(tmp_path):
    trace = tmp_path / "trace.txt"
    store = make_store(tmp_path, offload_trace=str(trace))
    try:
        store.write(0, state(store, 0, seed=0))
        store.read(0, store.cache.allocate())
    finally:
        store.close()
    ops = [line.split()[2] for line in trace.read_text().splitlines()]
    assert ops == ["write", "read"]


def test_close_removes_the_rank_directories(tmp_path):
    store = make_store(tmp_path)
    store.write(0, state(store, 0, seed=0))
    rank_dir = store.rank_dirs[0]
    store.close()
    assert not os.path.exists(rank_dir)


def test_a_fetch_waits_for_the_subgroups_own_flush(tmp_path):
    """A subgroup evicted (its newer state still being written) and fetched again at once
    reads the newer state, not the file of the step before (a race CI once met)."""
    import threading
    import time

    store = make_store(tmp_path, cache_subgroups=4)
    try:
        store.version[0] = 1
        store.write(0, state(store, 0, seed=1))  # the file holds step 1
        newer = state(store, 0, seed=2)
        expected = newer.clone()
        store.version[0] = 2
        store.cache.insert(0, newer, dirty=True)  # step 2's state, not written yet
        for i in (1, 2):
            store.cache.insert(i, state(store, i, seed=10 + i), dirty=False)
        real_write, started = store.write, threading.Event()

        def slow_write(subgroup, buffer, kind="state"):
            started.set()
            time.sleep(0.5)
            return real_write(subgroup, buffer, kind)

        store.write = slow_write
        _, flush = store.take_buffer(protect=())  # evicts 0: its flush starts, slowly
        assert flush is not None and started.wait(5) and not flush.done()
        fetched = store.start_fetch(0, protect=()).result()
        n = store.sizes[0]
        assert torch.equal(fetched[:n], expected[:n])
    finally:
        store.close()


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_remainder_layout_round_trips_through_cache_and_files(tmp_path, moments):
    """Remainders: 10 (6) bytes per element in the host buffers and files, bit for bit."""
    from megatron_ext.offload.state_format import read_header

    layout = StateLayout.from_names("fp32", moments, moments).with_remainders()
    assert layout.bytes_per_element == (10 if moments == "fp32" else 6)
    assert layout.dtypes[0] == torch.int16 and layout.names == ["fp32", moments, moments]
    store = make_store(tmp_path, n_paths=1, layout=layout)
    try:
        assert store.sizes[0] == layout.nbytes(SIZE) == SIZE * layout.bytes_per_element
        assert store.buffer_bytes == layout.nbytes(SIZE)
        gen = torch.Generator().manual_seed(3)
        buffer = store.cache.allocate()
        rem, exp_avg, exp_avg_sq = store.views(buffer, 2)
        rem.copy_(torch.randint(-2**15, 2**15, (SIZE,), generator=gen, dtype=torch.int16))
        exp_avg.copy_(torch.randn(SIZE, generator=gen))
        exp_avg_sq.copy_(-torch.rand(SIZE, generator=gen))  # sign bits set: "up" bits
        written = buffer[:store.sizes[2]].clone()
        store.write(2, buffer)
        name = store.file(2, store.location[2])
        assert read_header(name)["payload_bytes"] == layout.nbytes(SIZE)
        back = store.cache.allocate()
        store.read(2, back)
        assert torch.equal(back[:store.sizes[2]], written)
    finally:
        store.close()
