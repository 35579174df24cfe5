"""Run megatron-core on a machine without a GPU.

megatron-core 0.16.1 assumes CUDA in a handful of places (buffers allocated on
``torch.cuda.current_device()``, ``device='cuda'`` literals, ``param.type()`` checked
against ``'torch.cuda.FloatTensor'``, ``torch.cuda.synchronize()``, ...). Rather than
fork those files, this module installs, process-wide and only when the run's device
is the CPU:

* a :class:`torch.overrides.TorchFunctionMode` that rewrites every CUDA device argument
  to ``cpu``, makes ``Tensor.cuda()`` a no-op and reports ``torch.cuda.*`` type names
  from ``Tensor.type()`` (so megatron-core's dtype checks pass);
* small replacements of the ``torch.cuda`` entry points megatron-core calls
  (synchronize, streams, events, memory statistics, current device), and of the CUDA
  generator state that activation recomputation saves and restores (the CPU's here).

The cost is about a millisecond per forward+backward of a tiny model. Because CUDA is
mapped away, a CPU run cannot catch device-placement bugs (streams, pinned memory,
H2D/D2H): those are covered by ``tests/gpu`` on a real GPU.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_installed = False
_lock = threading.Lock()


def _map_device(device):
    """Returns ``cpu`` for any CUDA device spelling, the argument otherwise."""
    if device is None:
        return None
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str):
        return _CPU if device.startswith("cuda") else device
    if isinstance(device, torch.device):
        return _CPU if device.type == "cuda" else device
    return device


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


class CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA devices to the CPU for every torch call made while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CUDA_TYPE_NAMES.get(args[0].dtype, func(*args))
        if func is torch.Tensor.is_cuda.__get__:
            return True
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _map_device(args[1])) + tuple(args[2:])
        return func(*args, **kwargs)


class _NullStream:
    """Stand-in for ``torch.cuda.Stream``: work on the CPU is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event or _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _NullEvent:
    """Stand-in for ``torch.cuda.Event``."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    null_stream = _NullStream()
    patches = {
        "current_device": lambda: 0,
        "set_device": lambda *a, **k: None,
        "synchronize": lambda *a, **k: None,
        "empty_cache": lambda: None,
        "Stream": _NullStream,
        "Event": _NullEvent,
        "current_stream": lambda *a, **k: null_stream,
        "default_stream": lambda *a, **k: null_stream,
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "memory_allocated": lambda *a, **k: 0,
        "max_memory_allocated": lambda *a, **k: 0,
        "memory_reserved": lambda *a, **k: 0,
        "max_memory_reserved": lambda *a, **k: 0,
        "reset_peak_memory_stats": lambda *a, **k: None,
        "nvtx": type("nvtx", (), {"range_push": staticmethod(lambda *a: None),
                                  "range_pop": staticmethod(lambda *a: None),
                                  "range": staticmethod(lambda *a, **k: contextlib.nullcontext())}),
    }
    for name, value in patches.items():
        setattr(cuda, name, value)


def _patch_rng_checkpointing() -> None:
    """Activation recomputation saves and restores the "CUDA" generator: here, the CPU's.

    megatron-core's CheckpointFunction (--recompute-granularity full) snapshots the CPU and
    the CUDA generator before the forward and restores both for the recomputation, so that
    dropout draws the same masks. On the CPU, dropout draws from the CPU generator; reading
    the CUDA one would initialize CUDA and fail.
    """
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


def install() -> None:
    """Installs the CPU compatibility layer for this process (idempotent).

    Call it before megatron-core builds any model, buffer or optimizer. It must not be
    installed on a machine that trains on a GPU.
    """
    global _installed
    with _lock:
        if _installed:
            return
        if torch.cuda.is_available():
            raise RuntimeError("cpu_compat must not be installed when CUDA is used")
        _patch_torch_cuda()
        _patch_rng_checkpointing()
        # The mode is entered for the life of the process. torch keeps one mode stack per
        # thread: code that runs megatron-core in threads of its own must enter
        # CudaToCpuMode there too.
        CudaToCpuMode().__enter__()
        _installed = True
