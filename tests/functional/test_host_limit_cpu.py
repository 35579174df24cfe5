"""A job under a host memory limit the node does not show: ``ulimit -v`` and a memory cgroup.

The node's MemAvailable says there is room; the job's own limit says there is not. The
memory plan reads the tighter one (megatron_ext.runtime.host_memory) and refuses in one
line before the model is built, naming what bounds it, where the old plan said "fits" and
the job then died in the model build (a failed allocation under ``ulimit -v``, SIGKILL from
the kernel under a cgroup). The cgroup case needs a writable memory cgroup (root on a
cgroup v1 or delegated v2 hierarchy); elsewhere it is skipped with that reason.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from mext_testing import PRETRAIN, ROOT, TINY, test_env

# ~0.16B parameters: the plan counts ~3.3 GB of host memory for it on the CPU.
BIG = [a for a in TINY]
for flag, value in (("--num-layers", "12"), ("--hidden-size", "1024"),
                    ("--num-attention-heads", "8")):
    BIG[BIG.index(flag) + 1] = value
BIG += ["--train-iters", "2"]
GIB = 1 << 30


def run(preexec=None, timeout=120):
    return subprocess.run([sys.executable, PRETRAIN, *BIG], cwd=ROOT, env=test_env({}),
                          capture_output=True, text=True, timeout=timeout,
                          preexec_fn=preexec)


def assert_refused_before_the_model(result, bound):
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr)
    err = result.stderr.strip().splitlines()
    assert len(err) == 1, result.stderr
    assert "of host memory" in err[0] and bound in err[0], err[0]
    assert "Traceback" not in result.stdout + result.stderr
    assert "building the model" not in result.stdout


def test_ulimit_v_is_the_bound_the_plan_keeps():
    # 2.5 GiB of address space: the interpreter with torch and megatron-core takes ~1.2 of
    # it before the plan; the model's ~3.3 GB cannot come. MemAvailable alone said "fits".
    limit = int(2.5 * GIB)
    result = run(lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert_refused_before_the_model(result, "(under ulimit -v)")


def _writable_cgroup() -> Path:
    """A fresh child of this process's memory cgroup, or skip saying why there is none."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = [l.split(":", 2)[2] for l in lines if "memory" in l.split(":", 2)[1].split(",")]
    v2 = [l.split(":", 2)[2] for l in lines if l.startswith("0::")]
    if v1:
        parent, limit_file = Path("/sys/fs/cgroup/memory" + v1[0]), "memory.limit_in_bytes"
    elif v2:
        parent, limit_file = Path("/sys/fs/cgroup" + v2[0]), "memory.max"
    else:
        pytest.skip("no memory cgroup on this machine")
    child = parent / f"mext-test-{os.getpid()}"
    try:
        child.mkdir()
    except OSError as err:
        pytest.skip(f"the memory cgroup {parent} is not writable here ({err.strerror})")
    if not (child / limit_file).exists():
        child.rmdir()
        pytest.skip(f"{parent} does not delegate the memory controller")
    return child, limit_file


def test_a_memory_cgroup_is_the_bound_the_plan_keeps():
    child, limit_file = _writable_cgroup()
    try:
        (child / limit_file).write_text(str(int(1.5 * GIB)))
        procs = str(child / "cgroup.procs")

        def enter():
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        result = run(enter)
    finally:
        for _ in range(50):  # the killed or exited child leaves the cgroup shortly
            try:
                child.rmdir()
                break
            except OSError:
                import time
                time.sleep(0.1)
    assert_refused_before_the_model(result, f"(under the memory cgroup {child})")
