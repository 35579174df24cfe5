"""Partition of the shard into subgroups, and the host cache's eviction order (pure logic)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.offload.cache import HostCache
from megatron_ext.offload.subgroups import layout_fingerprint, partition

CASES = [
    # numels, groups, size -> [(numel, [(param, start, length, offset)], runs)]
    ([10], [0], 4, [(4, [(0, 0, 4, 0)], [(0, 0, 4)]), (4, [(0, 4, 4, 0)], [(0, 0, 4)]),
                    (2, [(0, 8, 2, 0)], [(0, 0, 2)])]),
    ([3, 3], [0, 1], 4, [(4, [(0, 0, 3, 0), (1, 0, 1, 3)], [(0, 0, 3), (1, 3, 1)]),
                         (2, [(1, 1, 2, 0)], [(1, 0, 2)])]),
    ([2, 0, 2], [1, 0, 1], 8, [(4, [(0, 0, 2, 0), (2, 0, 2, 2)], [(1, 0, 4)])]),
    ([4, 4], [0, 0], 4, [(4, [(0, 0, 4, 0)], [(0, 0, 4)]), (4, [(1, 0, 4, 0)], [(0, 0, 4)])]),
]


@pytest.mark.parametrize("numels,groups,size,expected", CASES)
def test_partition(numels, groups, size, expected):
    subgroups = partition(numels, groups, size)
    got = [(sg.numel, [(p.param, p.start, p.length, p.offset) for p in sg.pieces],
            [tuple(r) for r in sg.runs]) for sg in subgroups]
    assert got == expected
    assert [sg.index for sg in subgroups] == list(range(len(subgroups)))
    assert sum(sg.numel for sg in subgroups) == sum(numels)


def test_partition_covers_every_element_once():
    numels = [7, 1, 30, 2, 19]
    seen = {i: [0] * n for i, n in enumerate(numels)}
    for sg in partition(numels, [0, 1, 0, 1, 0], 9):
        assert sg.numel <= 9
        for p in sg.pieces:
            for k in range(p.start, p.start + p.length):
                seen[p.param][k] += 1
    assert all(all(c == 1 for c in counts) for counts in seen.values())


def test_fingerprint_changes_with_the_layout():
    base = layout_fingerprint([3, 4], [0, 1], 100)
    assert base == layout_fingerprint([3, 4], [0, 1], 100)
    assert base != layout_fingerprint([4, 3], [0, 1], 100)
    assert base != layout_fingerprint([3, 4], [0, 1], 50)


def test_cache_evicts_least_recently_used_and_respects_capacity():
    cache = HostCache(2, lambda: torch.empty(1))
    for sg in (0, 1):
        assert cache.can_allocate()
        cache.insert(sg, cache.allocate(), dirty=False)
    assert not cache.can_allocate()
    cache.get(0)  # 0 becomes the most recent
    assert cache.victim(exclude=()) == 1
    assert cache.victim(exclude=(1,)) == 0
    entry = cache.pop(1)
    cache.release(entry.buffer)
    assert cache.can_allocate() and cache.allocated == 2
