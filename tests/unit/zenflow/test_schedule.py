"""ZenFlow's pure rules: the auto interval and its lower bound from the CPU's Adam time,
the accumulation place (auto) from the device's free memory, the CPUs of the host threads."""

from __future__ import annotations

import pytest

from megatron_ext.errors import UsageError
from megatron_ext.zenflow import accumulation, cpu_affinity
from megatron_ext.zenflow.config import AUTO_MAX_INTERVAL, FREE_BYTES_ENV, ZenFlowConfig
from megatron_ext.zenflow.schedule import StepPlan, WindowSchedule, adam_floor, auto_interval

GIB = 2 ** 30


@pytest.mark.parametrize("adam_s,step_s,expected", [
    (1.0, 0.2, 7),       # 1.25 x 1.0 s over 0.2 s steps: 6.25 -> 7 steps
    (1.0, 0.25, 5),      # exactly 5.0 steps
    (0.1, 0.2, 1),       # Adam shorter than a step: no bound
    (0.0, 0.2, 1),       # no update measured yet
    (1.0, 0.0, 1),       # no step time yet (the first window)
    (100.0, 0.2, AUTO_MAX_INTERVAL),  # capped: the boundary waits rather than S grow
    (float("nan"), 0.2, 1),
    (float("inf"), 0.2, 1),
])
def test_adam_floor(adam_s, step_s, expected):
    assert adam_floor(adam_s, step_s) == expected


@pytest.mark.parametrize("rho,floor,expected", [
    (0.5, 1, 2),         # floor(1 / 0.5)
    (0.3, 1, 3),
    (0.01, 1, 16),       # few delayed gradients: the longest window
    (0.9, 1, 1),
    (0.9, 5, 5),         # the CPU's Adam needs 5 steps: never shorter
    (0.3, 2, 3),         # the rule's length is longer than the bound: the rule
    (0.9, 40, 16),       # the bound never passes the longest window
])
def test_auto_interval(rho, floor, expected):
    assert auto_interval(rho, floor) == expected


def test_auto_window_follows_the_floor():
    """The schedule takes the engine's bound at a window's end; a fixed interval ignores it."""
    auto = WindowSchedule(ZenFlowConfig(zenflow=True, zenflow_update_interval="auto"))
    fixed = WindowSchedule(ZenFlowConfig(zenflow=True, zenflow_update_interval="4"))
    for schedule in (auto, fixed):
        for _ in range(4):
            plan = schedule.next_step()
            schedule.end_step(plan, 0.9, floor=6 if plan.closes_window else 1)
        assert plan.closes_window
    assert auto.window_length == 6 and fixed.window_length == 4
    plan = auto.next_step()
    assert isinstance(plan, StepPlan) and auto.in_window == 1


@pytest.mark.parametrize("mode,need,free,total,place", [
    ("auto", 4 * GIB, 80 * GIB, 140 * GIB, "device"),
    ("auto", 4 * GIB, 10 * GIB, 140 * GIB, "host"),     # 4 + 7 (a twentieth) > 10
    ("auto", 4 * GIB, 12 * GIB, 140 * GIB, "device"),   # 4 + 7 <= 12
    ("auto", 4 * GIB, int(4.9 * GIB), None, "host"),    # margin 1 GiB without a total
    ("auto", 4 * GIB, 5 * GIB, None, "device"),
    ("auto", 4 * GIB, None, None, "host"),              # a CPU run: nothing to measure
    ("auto", 0, 2 * GIB, 16 * GIB, "device"),           # all columns selected
    ("device", 4 * GIB, 0, 140 * GIB, "device"),        # asked for: no measurement
    ("host", 4 * GIB, 80 * GIB, 140 * GIB, "host"),
])
def test_choose_place(mode, need, free, total, place):
    got, why = accumulation.choose_place(mode, need, free, total)
    assert got == place and why


def test_choose_place_refuses_other_modes():
    with pytest.raises(UsageError, match="auto, device or host"):
        accumulation.choose_place("gpu", 1, 1, 1)
    with pytest.raises(UsageError, match="auto, device or host"):
        ZenFlowConfig(zenflow=True, zenflow_accumulate="gpu")
    with pytest.raises(UsageError, match="needs --zenflow"):
        ZenFlowConfig(zenflow_accumulate="device")


def test_free_memory_hook(monkeypatch):
    import torch

    def hook():  # the knob as a run's config made now reads it (its variable)
        return ZenFlowConfig().zenflow_device_free_bytes

    monkeypatch.delenv(FREE_BYTES_ENV, raising=False)
    assert accumulation.measured_free_memory(torch.device("cpu"), hook()) == (None, None)
    monkeypatch.setenv(FREE_BYTES_ENV, "12345")
    assert accumulation.measured_free_memory(torch.device("cpu"), hook()) == (12345, None)
    monkeypatch.setenv(FREE_BYTES_ENV, "lots")
    with pytest.raises(UsageError, match="number of bytes"):
        accumulation.measured_free_memory(torch.device("cpu"), hook())


# 16 CPUs as 8 cores of two hardware threads, numbered i and i + 8 (the common layout),
# or numbered 2i and 2i + 1.
SPLIT = {c: {c % 8, c % 8 + 8} for c in range(16)}
PAIRED = {c: {c - c % 2, c - c % 2 + 1} for c in range(16)}


@pytest.mark.parametrize("allowed,machine,ranks,siblings,expected", [
    (range(16), 16, 1, SPLIT, set(range(2, 8)) | set(range(10, 16))),
    (range(16), 16, 1, PAIRED, set(range(2, 16))),
    (range(16), 16, 2, SPLIT, set(range(4, 8)) | set(range(12, 16))),
    (range(16), 16, 4, SPLIT, None),       # the loops' cores are all there is
    (range(16), 16, 1, {}, set(range(2, 16))),
])
def test_default_host_cpus_leave_the_loops_cores_free(allowed, machine, ranks, siblings,
                                                      expected):
    """No host thread on a core of the CPUs left to the loops (hyperthread siblings)."""
    got = cpu_affinity.default_host_cpus(set(allowed), machine, ranks, siblings)
    assert got == expected
    if got is not None:
        loop = sorted(allowed)[:cpu_affinity.LOOP_CPUS * ranks]
        cores = set().union(*(siblings.get(c, {c}) for c in loop))
        assert not got & cores


def test_cpu_siblings_reads_this_machine():
    import os

    allowed = os.sched_getaffinity(0)
    siblings = cpu_affinity.cpu_siblings(allowed)
    for cpu, core in siblings.items():
        assert cpu in core
    assert cpu_affinity.parse_cpus("0-2,5") == {0, 1, 2, 5}
