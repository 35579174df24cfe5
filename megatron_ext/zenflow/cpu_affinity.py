"""The CPUs and threads of ZenFlow's CPU side (pure: no torch, no threads started).

The CPU side's threads (accumulation, Adam, and the workers they start) are confined to a
set of CPUs so that the training loop's own thread, which launches the GPU's kernels, keeps
the others. :func:`parse_cpus` and :func:`check_cpus` read the ``--zenflow-cpus`` knob
(``MEGATRON_EXT_ZENFLOW_CPUS``), :func:`host_cpus` turns it into the set the threads run
on, :func:`default_threads` gives the accumulation's thread count.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

LOOP_CPUS = 2
"""CPUs per training process that the CPU side's threads leave free by default (on GPUs)."""

_CPUS_HINT = "give CPU numbers and ranges, e.g. 2-15 or 1,3,8-11, or all"


def parse_cpus(text: str) -> set:
    """"0-2,5" -> {0, 1, 2, 5} (raises ValueError)."""
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        first, last = int(lo), int(hi) if hi else int(lo)
        if first < 0 or last < first:
            raise ValueError(part)
        cpus.update(range(first, last + 1))
    return cpus


def check_cpus(text: str) -> str:
    """The ``--zenflow-cpus`` knob's text, checked; raises ValueError with what to give.

    CPU numbers and ranges ("2-15", "1,3,8-11"), a non-empty subset of the CPUs this
    process may use, or "all"; empty: unset (:func:`host_cpus`'s default).
    """
    if text in ("", "all"):
        return text
    try:
        cpus = parse_cpus(text)
    except ValueError:
        raise ValueError(_CPUS_HINT) from None
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ValueError(f"CPUs {sorted(cpus - allowed)} are not available to this process "
                         f"(it may use {cpu_ranges(allowed)})")
    return text


def host_cpus(spec: str, default: bool = False) -> Optional[set]:
    """The CPUs of the CPU side's threads, as a set; None: no confinement.

    ``spec``: the ``--zenflow-cpus`` knob (:func:`check_cpus`): CPU numbers and ranges, or
    "all". Empty (unset): with ``default`` (the GPU side is a CUDA device)
    :func:`default_host_cpus`, else all. The CPU side's threads (accumulation, Adam, and
    the workers they start: the C kernel's threads and torch's OpenMP team inherit the
    mask) run on these CPUs only, so that the training loop's own thread, which launches
    the GPU's kernels, keeps the others.
    """
    allowed = os.sched_getaffinity(0)
    if not spec:
        if not default:
            return None
        return default_host_cpus(allowed, os.cpu_count() or len(allowed), _local_ranks(),
                                 cpu_siblings(allowed))
    if spec == "all":
        return None
    return parse_cpus(check_cpus(spec))


def default_host_cpus(allowed: set, machine_cpus: int, local_ranks: int,
                      siblings: Optional[Dict[int, set]] = None) -> Optional[set]:
    """All CPUs this process may use but the first LOOP_CPUS per training process on them.

    And but their hyperthread siblings (``siblings``: CPU -> the CPUs of its core, itself
    included; :func:`cpu_siblings`): a host thread on the other hardware thread of a
    loop's core would share that core's execution units and caches with the thread that
    launches the GPU's kernels.

    A process bound to its own CPUs (fewer than the machine's: Slurm's or numactl's
    binding) leaves LOOP_CPUS of them; one that may use the whole machine shares it with the
    other ranks of its node, all of which leave the same first LOOP_CPUS x ranks CPUs to
    their loops' threads. No confinement (None) when fewer CPUs than that would be left to
    the host threads. On the 16-core H200 machine (1.28B GPT, k=0.1, S=4; bench/results/
    2026-12-01b-h200, calls 1 and 4): 0.237 and 0.249 s per step with the host threads on
    every CPU, 0.213 and 0.224 on CPUs 2-15 (0.184 and 0.190 without offload): the loop's
    forward-backward went from 0.143-0.154 s back to 0.133-0.136, the no-offload figure.
    """
    ordered = sorted(allowed)
    sharing = local_ranks if len(ordered) >= machine_cpus else 1
    reserve = LOOP_CPUS * max(1, sharing)
    loop = set(ordered[:reserve])
    for cpu in ordered[:reserve]:
        loop |= set((siblings or {}).get(cpu, ()))
    host = set(ordered) - loop
    if len(host) < reserve:
        return None
    return host


def cpu_siblings(cpus) -> Dict[int, set]:
    """CPU -> the CPUs of its core (Linux's topology/thread_siblings_list); {} unknown."""
    out = {}
    for cpu in cpus:
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        try:
            with open(path) as f:
                out[cpu] = parse_cpus(f.read().strip())
        except (OSError, ValueError):
            return {}
    return out


def _local_ranks() -> int:
    """Training processes on this node (torchrun's LOCAL_WORLD_SIZE, Slurm's tasks)."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def cpu_ranges(cpus) -> str:
    """A set of CPU numbers as taskset writes it: {0, 1, 2, 5} -> "0-2,5"."""
    out, run = [], []
    for cpu in sorted(cpus):
        if run and cpu != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(cpu)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def default_threads(threads: Optional[int], cpus: Optional[set], torch_threads: int) -> int:
    """Threads for one accumulation.

    ``threads`` (the ``--zenflow-threads`` knob, ``MEGATRON_EXT_ZENFLOW_THREADS``) when
    given; else half of torch's intra-op count ``torch_threads`` (OMP_NUM_THREADS, CPU
    affinity), at least one, and no more than the CPU side's ``cpus`` (:func:`host_cpus`).
    The accumulation shares the host's memory bandwidth and cores with the training loop's
    own thread (which launches the GPU kernels) and with the CPU Adam of the previous
    window. On the 16-core H200 machine (1.28B GPT, k=0.1, S=4;
    bench/results/2026-11-30-h200-zenflow-bench): 16 threads slowed the loop's kernel
    launches (forward-backward 0.150 s instead of 0.135), 4 could not keep up (25% of the
    time waiting for the host), 8 with three staging slots left no wait at all.
    """
    if threads:
        return threads
    count = max(1, torch_threads // 2)
    return min(count, len(cpus)) if cpus else count
