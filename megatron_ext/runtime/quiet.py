"""Silencing the log noise of the libraries underneath: warnings that do not apply to the run.

Three kinds: megatron-core's import-time warnings about optional packages it falls back from
(:func:`quiet_optional_dependencies`), its CUDA-only advice on a CPU run
(:func:`quiet_cuda_advice`), and lines that native code writes straight to file descriptor
2, such as torch's profiler's ``USDT:`` trace marks (:func:`native_lines_dropped`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import warnings
from typing import Iterator, Sequence

# Lines native code prints to stderr that say nothing to the user. torch's profiler (kineto)
# marks its start and stop with "USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52]
# profiler_start" at a level above its ERROR, so that KINETO_LOG_LEVEL can only hide them
# together with its errors.
NATIVE_NOISE = ("USDT:",)


def quiet_optional_dependencies() -> None:
    """megatron-core warns at import about every optional package it falls back from."""
    for pattern in (".*Apex is not installed.*", ".*Transformer Engine.*",
                    ".*transformer_engine.*", ".*nvidia-modelopt.*", ".*flattened_range.*",
                    ".*full scope is deprecated.*", ".*is not a leaf Tensor is being accessed.*",
                    r".*`torch\.distributed\.\w+` is deprecated.*",
                    ".*`load_state_dict` is deprecated.*", ".*deprecating ShardedTensor.*",
                    # megatron.core.hyper_comm_grid, where absl-py is missing: it logs
                    # through the standard logging module instead, which is what we want.
                    ".*absl.logging is not installed.*"):
        warnings.filterwarnings("ignore", message=pattern)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    # The notices of one megatron-core version (its own deprecations) live with the
    # other version differences.
    from megatron_ext.runtime import mcore_compat

    mcore_compat.quiet()


def quiet_cuda_advice() -> None:
    """On a CPU run, hides megatron-core's advice to set CUDA_DEVICE_MAX_CONNECTIONS=1.

    megatron-core gives it once per process with tensor parallelism (async grad all-reduce)
    or sequence parallelism, whatever the device; the variable orders CUDA streams, so on
    the CPU it cannot apply. A GPU run keeps the warning.
    """
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")


@contextlib.contextmanager
def native_lines_dropped(prefixes: Sequence[str] = NATIVE_NOISE) -> Iterator[None]:
    """Runs the block with file descriptor 2 in a temporary file, then passes its lines on.

    Every line written to stderr during the block, by Python or native code, reaches the
    real stderr when the block ends (also when it raises), in order, except those that
    start with one of ``prefixes``. Meant for short calls that print such lines (starting
    and stopping torch's profiler), not for long stretches: the lines are held until the
    block ends.
    """
    marks = tuple(p.encode() for p in prefixes)
    sys.stderr.flush()
    real = os.dup(2)
    try:
        with tempfile.TemporaryFile() as held:
            os.dup2(held.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(real, 2)
                held.seek(0)
                for line in held:
                    if not line.startswith(marks):
                        os.write(2, line)
    finally:
        os.close(real)
