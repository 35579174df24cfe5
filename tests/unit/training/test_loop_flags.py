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
    assert 0.0 < loop._minutes_since_start() < 60.0
