"""One-pass host-memory kernels (megatron_ext/csrc/host_kernels.c), built on first use.

:func:`adamw`: the host AdamW of the offload engine and of ZenFlow's CPU side on GPU
machines. It reads and writes each element once, and every element takes the same
operations wherever it sits in a call: the same states cut into other pieces (subgroups, a
re-selection's new layout, another thread count) keep the same bits, which torch's fused
CPU AdamW does not give (its vector loop and scalar tail round differently).

ZenFlow's CPU side adds every step's delayed gradients (about 90% of the model) into an
fp32 accumulator in host memory. In torch that is three passes (convert into a temporary,
multiply in place, add) and the accumulation became the slowest part of a ZenFlow step on
the GPU machine; the C kernel reads the gradient and the accumulator once, with torch's
arithmetic (same operations, same order, no fused multiply-add), so results are unchanged
bit for bit.

The library is compiled with the system C compiler (``$CC`` or ``cc``) into
``$MEGATRON_EXT_CACHE`` (default ``~/.cache/megatron_ext``), under a name that hashes the
source, the compiler and this CPU's instruction-set flags (the build uses -march=native:
a cache shared by nodes with other CPUs gets one build per kind), written to a temporary
name and renamed, so concurrent ranks never load a half-written file. Without a compiler,
or when the build fails, :func:`load` returns None once with a warning and callers use
their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "host_kernels.c"
# -fno-math-errno lets the square root vectorize (an IEEE sqrt either way).
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno",
         "-fPIC", "-shared", "-pthread"]

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_lock = threading.Lock()
_loaded: Optional[ctypes.CDLL] = None
_tried = False


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def _cache_dir() -> Path:
    root = os.environ.get("MEGATRON_EXT_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "megatron_ext")
    return Path(root) / "kernels"


def _build() -> Optional[ctypes.CDLL]:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler (cc, gcc or $CC): ZenFlow's host accumulation uses torch "
                    "(slower; install gcc for the one-pass kernel)")
        return None
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(b"\0".join([
        SOURCE.read_bytes(), version.encode(), " ".join(FLAGS).encode(),
        _cpu_flags().encode()])).hexdigest()[:16]
    target = _cache_dir() / f"host_kernels-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
        os.close(fd)
        result = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp],
                                capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            first = (result.stderr.strip().splitlines() or ["(no output)"])[0]
            log.warning("building %s failed (%s): ZenFlow's host accumulation uses torch",
                        SOURCE.name, first)
            return None
        os.replace(tmp, target)
    lib = ctypes.CDLL(str(target))
    fn = lib.mext_accumulate
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int]
    fn = lib.mext_adamw
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_float] * 7 + [
        ctypes.c_int]
    return lib


def load() -> Optional[ctypes.CDLL]:
    """The built library, or None (no compiler, a failed build).

    Callers that may use the torch path instead decide so themselves (ZenFlow's
    ``zenflow_no_host_kernels`` knob, $MEGATRON_EXT_NO_HOST_KERNELS) and then do not ask.
    """
    global _loaded, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _loaded = _build()
            except OSError as exc:
                log.warning("host kernels unavailable (%s): ZenFlow's host accumulation "
                            "uses torch", exc)
        return _loaded


MAX_STEPS = 64
"""Gradients one call can add (the C kernel's MAX_STEPS)."""


def supports(acc: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether :func:`accumulate` can take these tensors."""
    return (acc.dtype == torch.float32 and grad.dtype in _DTYPES and acc.device.type == "cpu"
            and grad.device.type == "cpu" and acc.is_contiguous() and grad.is_contiguous()
            and acc.numel() == grad.numel())


def accumulate(lib: ctypes.CDLL, acc: torch.Tensor, grad: torch.Tensor, *,
               inv_scale: Optional[float], clip: Optional[float], first: bool,
               divisor: Optional[int], threads: int) -> None:
    """``acc = ((0 if first else acc) + grad * inv_scale * clip) / divisor``, in fp32.

    ``None`` leaves a factor out. The same roundings as torch's ``copy_`` to fp32,
    ``mul_``, ``mul_``, ``add_`` and ``div_`` in that order.
    """
    accumulate_steps(lib, acc, [grad], [inv_scale], [clip], first=first, divisor=divisor,
                     threads=threads)


def accumulate_steps(lib: ctypes.CDLL, acc: torch.Tensor, grads: Sequence[torch.Tensor],
                     inv_scales: Sequence[Optional[float]], clips: Sequence[Optional[float]],
                     *, first: bool, divisor: Optional[int], threads: int) -> None:
    """:func:`accumulate` of several steps' ``grads`` (one dtype) in one pass over ``acc``.

    Bit for bit what one :func:`accumulate` per step gives (``first`` applies to the first
    step, ``divisor`` after the last), reading and writing the accumulator once.
    """
    count = len(grads)
    if not 1 <= count <= MAX_STEPS or len(inv_scales) != count or len(clips) != count:
        raise ValueError(f"accumulate_steps: 1 to {MAX_STEPS} grads, one scale and one clip "
                         "factor each")
    if any(not supports(acc, g) for g in grads) or len({g.dtype for g in grads}) != 1:
        raise ValueError("accumulate: needs contiguous CPU tensors of equal size, fp32 "
                         "accumulator, fp32/bf16/fp16 gradients of one dtype")
    pointers = (ctypes.c_void_p * count)(*[g.data_ptr() for g in grads])
    has_inv = (ctypes.c_int * count)(*[int(x is not None) for x in inv_scales])
    inv = (ctypes.c_float * count)(*[float(x) if x is not None else 1.0 for x in inv_scales])
    has_clip = (ctypes.c_int * count)(*[int(x is not None) for x in clips])
    clip = (ctypes.c_float * count)(*[float(x) if x is not None else 1.0 for x in clips])
    lib.mext_accumulate(
        acc.data_ptr(), pointers, _DTYPES[grads[0].dtype], count, acc.numel(), has_inv, inv,
        has_clip, clip, int(first), int(divisor is not None),
        float(divisor if divisor is not None else 1.0), max(1, int(threads)))


def adamw_supports(*tensors: torch.Tensor) -> bool:
    """Whether :func:`adamw` can take these (master, grad, exp_avg, exp_avg_sq)."""
    n = tensors[0].numel()
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
               and t.numel() == n for t in tensors)


def adamw(lib: ctypes.CDLL, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
          exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
          eps: float, weight_decay: float, threads: int) -> None:
    """One AdamW step in place (the ``step``-th), torch's AdamW to rounding, in one pass.

    The scalars are torch's (``_single_tensor_adam``): bias corrections, step size and
    the square root of the second correction in double, rounded to fp32 for the kernel.
    """
    if not adamw_supports(master, grad, exp_avg, exp_avg_sq):
        raise ValueError("adamw: needs contiguous fp32 CPU tensors of one size")
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    lib.mext_adamw(master.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(),
                   exp_avg_sq.data_ptr(), master.numel(), 1 - lr * weight_decay,
                   1 - beta1, beta2, 1 - beta2, bias_correction2 ** 0.5, eps, -step_size,
                   max(1, int(threads)))
