#!/usr/bin/env python3
"""Runs a script with every large pinned host allocation of its main process traced.

Where the pinned host memory of a GPU run comes from (issue 37: ~8 GB of torch's caching
host allocator appeared in Llama-3-8B's first forward, outside the memory plan): the Python
entry points that pin (``Tensor.pin_memory``, ``torch.empty``/``zeros``/... with
``pin_memory=True``, and ``Tensor.to``, whose non-blocking device-to-host copy returns a
pinned CPU tensor) are wrapped; each pinned result of at least
``PINNED_TRACE_MIN_MB`` MB (default 16) is counted by the stack that made it. Every 2 s
and at exit, ``torch.cuda.host_memory_stats()`` (the caching host allocator's own count:
what C++ callers pin too) and the stacks so far are written to ``PINNED_TRACE_OUT``
(default ``pinned_trace.txt``).

A diagnostic of the bench drivers, not of the project: the wrappers cost a Python call per
``Tensor.to``.

Usage:
    PINNED_TRACE_OUT=$OUT/pinned.txt python3 bench/gpu/pinned_trace.py pretrain_gpt.py ARGS...
"""

from __future__ import annotations

import atexit
import collections
import functools
import os
import runpy
import sys
import threading
import time
import traceback

import torch

MIN_BYTES = int(float(os.environ.get("PINNED_TRACE_MIN_MB", "16")) * (1 << 20))
OUT = os.environ.get("PINNED_TRACE_OUT", "pinned_trace.txt")
_stacks = collections.defaultdict(lambda: [0, 0])  # stack -> [count, bytes]
_lock = threading.Lock()
_start = time.time()
_log = []  # (seconds, the allocator's bytes) each 2 s


def _note(result):
    if not isinstance(result, torch.Tensor) or result.device.type != "cpu":
        return result
    try:
        pinned = result.is_pinned()
    except RuntimeError:
        return result
    nbytes = result.untyped_storage().nbytes()
    if pinned and nbytes >= MIN_BYTES:
        frames = [f for f in traceback.extract_stack()[:-2] if "pinned_trace" not in f.filename]
        key = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                          for f in reversed(frames[-8:]))
        with _lock:
            _stacks[key][0] += 1
            _stacks[key][1] += nbytes
    return result


def _wrap(owner, name: str, pinning) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        return _note(result) if pinning(args, kwargs) else result

    setattr(owner, name, wrapper)


def _stats() -> str:
    try:
        stats = torch.cuda.host_memory_stats()
    except Exception as err:  # no CUDA, or an older torch
        return f"host_memory_stats: {err}"
    keys = ("allocated_bytes.current", "allocated_bytes.peak", "active_bytes.current",
            "active_bytes.peak", "num_host_alloc", "num_host_free")
    return ", ".join(f"{k} {stats[k] / 1e9:.3f} GB" if "bytes" in k else f"{k} {stats[k]}"
                     for k in keys if k in stats)


def _write() -> None:
    with _lock:
        rows = sorted(_stacks.items(), key=lambda kv: -kv[1][1])
    with open(OUT, "w") as f:
        f.write(f"after {time.time() - _start:.1f} s: {_stats()}\n")
        f.write("the allocator's pinned bytes every 2 s (s, GB allocated, GB active):\n")
        f.writelines(f"  {t:7.1f} {a:8.3f} {b:8.3f}\n" for t, a, b in _log)
        f.write(f"pinned results of >= {MIN_BYTES >> 20} MB by stack (count, GB):\n")
        f.writelines(f"{n:6d} {b / 1e9:9.3f}  {key}\n" for key, (n, b) in rows)


def _watch() -> None:
    while True:
        time.sleep(2)
        try:
            stats = torch.cuda.host_memory_stats()
            _log.append((time.time() - _start, stats.get("allocated_bytes.current", 0) / 1e9,
                         stats.get("active_bytes.current", 0) / 1e9))
        except Exception:
            pass
        _write()


def main() -> None:
    for name in ("empty", "zeros", "ones", "full", "empty_strided", "empty_like",
                 "zeros_like", "tensor", "as_tensor"):
        if hasattr(torch, name):
            _wrap(torch, name, lambda a, k: bool(k.get("pin_memory")))
    _wrap(torch.Tensor, "pin_memory", lambda a, k: True)
    _wrap(torch.Tensor, "to", lambda a, k: bool(k.get("non_blocking"))
          or any(x is True for x in a[1:]))
    threading.Thread(target=_watch, daemon=True).start()
    atexit.register(_write)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as python3 SCRIPT would
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
