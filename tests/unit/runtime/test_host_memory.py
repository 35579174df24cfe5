"""The one measurement of the host memory a process may take: MemAvailable, a memory
cgroup's room (v1 and v2, the tightest of the process's cgroup and its ancestors) and
``ulimit -v``'s, on fake /proc and /sys/fs/cgroup trees."""

from __future__ import annotations

import resource

from megatron_ext.runtime import host_memory as hm

MIB = 1 << 20


def tree(tmp_path, meminfo_kb=8_000_000, cgroup="", files=None):
    (tmp_path / "meminfo").write_text(f"MemTotal: 16000000 kB\nMemAvailable: {meminfo_kb} kB\n")
    (tmp_path / "cgroup").write_text(cgroup)
    for rel, text in (files or {}).items():
        path = tmp_path / "sys" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "status").write_text("Name: python\nVmSize:\t  1048576 kB\nVmRSS: 10 kB\n")
    return dict(meminfo=str(tmp_path / "meminfo"), proc_cgroup=str(tmp_path / "cgroup"),
                cgroup_root=str(tmp_path / "sys"), status=str(tmp_path / "status"))


def test_without_limits_it_is_memavailable(tmp_path):
    room = hm.host_available(**tree(tmp_path))
    assert room == hm.HostAvailable(8_000_000 * 1024, "MemAvailable")


def test_a_v1_memory_cgroup_bounds_it_less_its_usage_and_reclaimable_cache(tmp_path):
    # A Slurm step's cgroup (v1 memory controller), 3 GiB, holding 1 GiB of which 256 MiB
    # is inactive page cache; the job cgroup above it is looser.
    paths = tree(tmp_path, cgroup="9:pids:/\n4:memory:/slurm/uid_0/job_7/step_0\n", files={
        "memory/slurm/uid_0/job_7/step_0/memory.limit_in_bytes": str(3 << 30),
        "memory/slurm/uid_0/job_7/step_0/memory.usage_in_bytes": str(1 << 30),
        "memory/slurm/uid_0/job_7/step_0/memory.stat": f"cache 1\ntotal_inactive_file {256 * MIB}\n",
        "memory/slurm/uid_0/job_7/memory.limit_in_bytes": str(6 << 30),
        "memory/slurm/uid_0/job_7/memory.usage_in_bytes": str(1 << 30),
        "memory/memory.limit_in_bytes": "9223372036854771712",  # the root: no limit
        "memory/memory.usage_in_bytes": str(5 << 30),
    })
    room = hm.host_available(**paths)
    assert room.bytes == (3 << 30) - (1 << 30) + 256 * MIB
    assert room.source == f"the memory cgroup {paths['cgroup_root']}/memory/slurm/uid_0/job_7/step_0"


def test_a_v2_cgroup_bounds_it_and_max_is_no_limit(tmp_path):
    files = {"system.slice/job.scope/memory.max": str(2 << 30),
             "system.slice/job.scope/memory.current": str(512 * MIB),
             "system.slice/job.scope/memory.stat": "anon 1\ninactive_file 0\n",
             "system.slice/memory.max": "max", "system.slice/memory.current": "1"}
    paths = tree(tmp_path, cgroup="0::/system.slice/job.scope\n", files=files)
    room = hm.host_available(**paths)
    assert room.bytes == (2 << 30) - 512 * MIB and "job.scope" in room.source
    files["system.slice/job.scope/memory.max"] = "max"
    paths = tree(tmp_path, cgroup="0::/system.slice/job.scope\n", files=files)
    assert hm.host_available(**paths).source == "MemAvailable"


def test_a_cgroup_looser_than_memavailable_does_not_raise_it(tmp_path):
    paths = tree(tmp_path, meminfo_kb=1000, cgroup="4:memory:/c\n", files={
        "memory/c/memory.limit_in_bytes": str(8 << 30), "memory/c/memory.usage_in_bytes": "0"})
    assert hm.host_available(**paths) == hm.HostAvailable(1000 * 1024, "MemAvailable")


def test_ulimit_v_bounds_it_less_the_address_space_in_use(tmp_path, monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (3 << 30, resource.RLIM_INFINITY))
    room = hm.host_available(**tree(tmp_path))
    assert room == hm.HostAvailable((3 << 30) - (1 << 30), "ulimit -v")


def test_no_ulimit_is_no_bound(tmp_path, monkeypatch):
    unlimited = resource.RLIM_INFINITY
    monkeypatch.setattr(resource, "getrlimit", lambda which: (unlimited, unlimited))
    assert hm.address_space_room(tree(tmp_path)["status"]) is None
