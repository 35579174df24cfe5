"""bench/gpu/memory_snapshot.py: the blocks alive at the allocator's peak, grouped by owner."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "gpu"))

import memory_snapshot  # noqa: E402


def _frames(path, func):
    return [{"filename": "/usr/lib/python3/torch/nn/functional.py", "name": "linear"},
            {"filename": f"/repo/{path}", "name": func}]


def test_peak_is_found_by_replay_and_grouped_by_first_owner_frame():
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _frames("megatron_ext/a.py", "f")},
        {"action": "alloc", "addr": 2, "size": 50, "frames": _frames("megatron/core/b.py", "g")},
        {"action": "free_completed", "addr": 2, "size": 50},
        {"action": "alloc", "addr": 3, "size": 70, "frames": _frames("megatron_ext/a.py", "f")},
        {"action": "alloc", "addr": 4, "size": 10, "frames": []},
        {"action": "free_completed", "addr": 3, "size": 70},
        {"action": "alloc", "addr": 5, "size": 60, "frames": _frames("megatron/core/b.py", "g")},
        # A free of a block allocated before the history started: ignored.
        {"action": "free_completed", "addr": 99, "size": 1000},
    ]
    peak, at, blocks = memory_snapshot.peak_blocks(events)
    # Totals after each alloc: 100, 150, (100), 170, 180, (110), 170: the peak is 180.
    assert (peak, at) == (180, 4)
    assert memory_snapshot.group(blocks) == [
        ("megatron_ext/a.py:f", 170, 2), ("(no frames)", 10, 1)]


def test_owner_without_project_frames_is_the_innermost_frame():
    frames = [{"filename": "/x/torch/cuda/memory.py", "name": "empty"}]
    assert memory_snapshot.owner(frames) == "memory.py:empty"
