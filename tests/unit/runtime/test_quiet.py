"""megatron_ext/runtime/quiet.py: the filters of the libraries' log noise."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from megatron_ext.runtime import quiet
from mext_testing import ROOT


def test_native_lines_dropped_keeps_the_other_lines_in_order():
    # In a process of its own: there sys.stderr writes to file descriptor 2, as in a run
    # (under pytest's capture it does not).
    script = textwrap.dedent("""
        import os, sys
        from megatron_ext.runtime import quiet
        print("before", file=sys.stderr, flush=True)
        with quiet.native_lines_dropped():
            # As native code writes: straight to file descriptor 2, bypassing sys.stderr.
            os.write(2, b"USDT:2026-12-03 07:30:44 1:1 SyncActivityProfilerHandler.cpp:52] "
                        b"profiler_start\\n")
            os.write(2, b"a native error line\\n")
            print("a Python line", file=sys.stderr)
            os.write(2, b"USDT:... profiler_stop\\nlast line, no newline")
        print("after", file=sys.stderr, flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ("before\na native error line\na Python line\n"
                           "last line, no newlineafter\n")


def test_native_lines_dropped_restores_stderr_when_the_block_raises(capfd):
    with pytest.raises(RuntimeError, match="boom"):
        with quiet.native_lines_dropped(prefixes=("noise",)):
            os.write(2, b"noise 1\nkept\n")
            raise RuntimeError("boom")
    os.write(2, b"afterwards\n")
    assert capfd.readouterr().err == "kept\nafterwards\n"


def test_torch_profiler_marks_are_dropped(capfd):
    import torch

    with quiet.native_lines_dropped():
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    torch.ones(4).sum()
    with quiet.native_lines_dropped():
        prof.__exit__(None, None, None)
    assert "USDT" not in capfd.readouterr().err


@pytest.mark.parametrize("message, hidden_on_cpu", [
    ("When using async grad allreduce it is recommended to set the environment variable "
     "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup", True),
    ("something else entirely", False)])
def test_cuda_advice_is_hidden(message, hidden_on_cpu):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.quiet_cuda_advice()
        warnings.warn(message, UserWarning)
    assert (len(caught) == 0) == hidden_on_cpu


def test_optional_dependency_warnings_are_hidden():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.quiet_optional_dependencies()
        warnings.warn("absl.logging is not installed. Using logging.getLogger(__name__) "
                      "instead.", UserWarning)
        warnings.warn("Apex is not installed", UserWarning)
        warnings.warn("a real problem", UserWarning)
    assert [str(w.message) for w in caught] == ["a real problem"]
