"""megatron-core's torch.compile'd functions are built at their first call (runtime/lazy_jit.py)."""

from __future__ import annotations

import subprocess
import sys

import torch

from megatron_ext.runtime import lazy_jit
from mext_testing import ROOT, test_env

PROBE = ("import sys, {first}; import megatron.core.jit as jit; import torch; "
         "from megatron.core.fusions import fused_bias_gelu as f; "
         "print('dynamo', 'torch._dynamo' in sys.modules, "
         "getattr(f.bias_gelu, 'compile_on_first_call', False), "
         "getattr(torch.compile, 'lazy_compile', False))")


def _probe(first: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], cwd=ROOT,
                         env=test_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_megatron_core_imported_after_this_project_leaves_dynamo_alone():
    # megatron_ext first (as pretrain_gpt.py and the tools): the fusions wait for a call.
    # torch.compile is torch's own again after the import.
    assert _probe("megatron_ext") == "dynamo False True False"
    # The check can fail: megatron-core on its own imports TorchDynamo at import.
    assert _probe("torch").startswith("dynamo True")


def fused(x, y):
    """A fusion."""
    return x * y + 1


def test_the_first_call_compiles_once_and_computes_the_same(monkeypatch):
    built = []

    def fake_compile(fn, **kwargs):
        built.append((fn, kwargs))
        return lambda *a, **k: fn(*a, **k) * 1  # the compiled function's result

    wrapped = lazy_jit.compile_on_first_call(fused)
    assert wrapped.__name__ == "fused" and wrapped.__doc__ == "A fusion." and not built
    monkeypatch.setattr(torch, "compile", fake_compile)
    x = torch.arange(4.0)
    assert torch.equal(wrapped(x, x), fused(x, x)) and built == [(fused, {})]
    assert torch.equal(wrapped(x, 2 * x), fused(x, 2 * x)) and built == [(fused, {})]


def test_the_stand_in_takes_torch_compiles_three_forms():
    built = []

    def real(model, **kwargs):
        built.append((model, kwargs))
        return model

    lazy = lazy_jit.lazy_compile(real)
    bare, called, direct = lazy(fused), lazy(dynamic=False)(fused), lazy(fused, mode="default")
    assert not built
    x = torch.ones(2)
    for f in (bare, called, direct):
        assert torch.equal(f(x, x), fused(x, x))
    assert built == [(fused, {}), (fused, {"dynamic": False}), (fused, {"mode": "default"})]
    module = torch.nn.Linear(2, 2)
    assert lazy(module) is module and built[-1] == (module, {})  # modules at once


def test_install_is_idempotent():
    before = list(sys.meta_path)
    lazy_jit.install()
    assert sys.meta_path == before
