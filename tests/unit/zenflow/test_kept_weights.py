"""KeptWeights: the old engine's weights a re-selection's new engine writes over."""

from __future__ import annotations

import types

import torch

from megatron_ext.zenflow.kept_weights import keep_for


def piece(param, start, length):
    return types.SimpleNamespace(param=param, start=start, length=length)


def engine(outs, subgroups, remainders=True):
    """An engine as KeptWeights sees it: params' ``out``, subgroups' pieces, its layout."""
    return types.SimpleNamespace(
        params=[types.SimpleNamespace(out=out) for out in outs],
        subgroups=[types.SimpleNamespace(pieces=pieces) for pieces in subgroups],
        layout=types.SimpleNamespace(remainders=remainders))


def test_needed_only_where_memory_is_shared_and_remainders_read_it():
    memory = torch.arange(10, dtype=torch.bfloat16)
    old = engine([memory[:8]], [[piece(0, 0, 8)]])
    new_shared = engine([memory[:6]], [[piece(0, 0, 6)]])
    new_own = engine([torch.zeros(6, dtype=torch.bfloat16)], [[piece(0, 0, 6)]])
    assert keep_for(old, new_shared) is not None
    assert keep_for(old, new_own) is None
    assert keep_for(None, new_shared) is None
    whole = engine([memory[:8]], [[piece(0, 0, 8)]], remainders=False)
    assert keep_for(whole, new_shared) is None  # whole masters: nothing read from out


def test_old_weights_are_read_back_where_the_new_ones_were_written():
    """Old param 0 at [0, 8) of the memory, old param 1 at [8, 12); the new engine's one
    param covers [2, 12) (an offset view). Old subgroups: [0, 5) and [5, 8) of param 0,
    all of param 1."""
    memory = torch.arange(12, dtype=torch.bfloat16)
    old = engine([memory[:8], memory[8:]],
                 [[piece(0, 0, 5)], [piece(0, 5, 3)], [piece(1, 0, 4)]])
    new = engine([memory[2:]], [[piece(0, 0, 4)], [piece(0, 4, 6)]])
    kept = keep_for(old, new)
    kept.save(new.subgroups[1].pieces)  # memory [6, 12): old param 0 [6, 8), param 1 [0, 4)
    assert {i: [(p, at, t.tolist()) for p, at, t in e] for i, e in kept.kept.items()} == {
        1: [(0, 6, [6.0, 7.0])], 2: [(1, 0, [8.0, 9.0, 10.0, 11.0])]}
    memory[6:].fill_(-1)  # the new subgroup's weights
    with kept.reading(0, 4, 4):
        assert old.params[0].out[4:8].tolist() == [4.0, 5.0, 6.0, 7.0]
    assert memory[6:].tolist() == [-1.0] * 6  # the new weights back after the read
    with kept.reading(1, 1, 2):
        assert old.params[1].out.tolist() == [-1.0, 9.0, 10.0, -1.0]  # only the read range
    kept.release(2)
    assert list(kept.kept) == [1] and kept.nbytes() == 4
    kept.save(new.subgroups[0].pieces)  # memory [2, 6): old subgroup 0 [2, 5), 1 [5, 6)
    assert sorted((i, at, t.numel()) for i, e in kept.kept.items() for _, at, t in e) == [
        (0, 2, 3), (1, 5, 1), (1, 6, 2)]
    kept.release(0)
    kept.release(1)
    assert kept.nbytes() == 0
    kept.save(new.subgroups[0].pieces)  # released subgroups are never kept again
    assert kept.nbytes() == 0
