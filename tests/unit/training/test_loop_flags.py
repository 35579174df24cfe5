"""Loop flags of Megatron-LM that need no training run to check."""

from __future__ import annotations

import types

import pytest

from megatron_ext.training import loop


@pytest.mark.parametrize("elapsed,limit,done", [(0.5, 1, False), (1.5, 1, True),
                                                (234.9, 235, False), (235.1, 235, True)])
def test_exit_duration_counts_minutes_since_the_process_started(monkeypatch, elapsed, limit,
                                                                 done):
    monkeypatch.setattr(loop, "_minutes_since_start", lambda: elapsed)
    trainer = types.SimpleNamespace(
        cfg=types.SimpleNamespace(training=types.SimpleNamespace(exit_duration_in_mins=limit)),
        runtime=types.SimpleNamespace(host_group=None))
    assert loop.Trainer._duration_reached(trainer) is done


def test_minutes_since_start_is_this_process_age():
    """Against the kernel's own count (/proc), not a bound: a test process of a slow suite
    may well be over an hour old."""
    import os

    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, in ticks
    uptime = float(open("/proc/uptime").read().split()[0])
    expected = (uptime - started) / 60.0
    assert expected > 0.0
    assert abs(loop._minutes_since_start() - expected) < 0.05
