"""megatron-core's torch.compile'd fusions are built at their first call (runtime/lazy_jit.py)."""

from __future__ import annotations

import subprocess
import sys

import torch

from megatron_ext.runtime import lazy_jit
from mext_testing import ROOT, test_env

PROBE = ("import sys, {first}; import megatron.core.jit as jit; "
         "from megatron.core.fusions import fused_bias_gelu as f; "
         "print('dynamo', 'torch._dynamo' in sys.modules, jit.jit_fuser.__name__, "
         "getattr(f.bias_gelu, 'compile_on_first_call', False))")


def _probe(first: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], cwd=ROOT,
                         env=test_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_megatron_core_imported_after_this_project_leaves_dynamo_alone():
    # megatron_ext first (as pretrain_gpt.py and the tools): the fusions wait for a call.
    assert _probe("megatron_ext") == "dynamo False compile_on_first_call True"
    # The check can fail: megatron-core on its own imports TorchDynamo at import.
    assert _probe("torch").startswith("dynamo True")


def test_the_first_call_compiles_once_and_computes_the_same(monkeypatch):
    built = []

    def fake_compile(fn):
        built.append(fn)
        return lambda *a, **k: fn(*a, **k) * 1  # the compiled function's result

    def fused(x, y):
        """A fusion."""
        return x * y + 1

    wrapped = lazy_jit.compile_on_first_call(fused)
    assert wrapped.__name__ == "fused" and wrapped.__doc__ == "A fusion." and not built
    monkeypatch.setattr(torch, "compile", fake_compile)
    x = torch.arange(4.0)
    assert torch.equal(wrapped(x, x), fused(x, x)) and built == [fused]
    assert torch.equal(wrapped(x, 2 * x), fused(x, 2 * x)) and built == [fused]


def test_install_is_idempotent():
    before = list(sys.meta_path)
    lazy_jit.install()
    assert sys.meta_path == before
