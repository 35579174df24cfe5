"""megatron_ext.training.step: the cached pinned blocks go back after the first iteration."""

import types

import torch

from megatron_ext.training import step


def test_release_cached_pinned_calls_torchs_host_cache_release(monkeypatch):
    calls = []
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        monkeypatch.delattr(torch._C, name, raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_emptyHostCache", lambda: calls.append(1),
                        raising=False)
    assert step.release_cached_pinned(types.SimpleNamespace(is_cpu=False)) is True
    assert calls == [1]
    # A CPU run has no pinned blocks of CUDA's: nothing is called.
    assert step.release_cached_pinned(types.SimpleNamespace(is_cpu=True)) is False
    assert calls == [1]


def test_release_cached_pinned_without_the_call_in_this_torch(monkeypatch):
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        monkeypatch.delattr(torch._C, name, raising=False)
    assert step.release_cached_pinned(types.SimpleNamespace(is_cpu=False)) is False
