"""megatron-core's torch.compile'd functions are built at their first call, not at import.

While ``import megatron.core`` runs, megatron-core decorates ~40 functions with
``torch.compile`` (its fusions through ``megatron.core.jit.jit_fuser``, and from 0.19 MoE
router methods directly). Each decoration imports and configures TorchDynamo and
Inductor: about 4 s of a 10 s start on a CPU machine, paid by every process (every rank,
every tool that imports megatron-core) whether or not one of those functions ever runs
(on the CPU none does). ``torch.compile`` compiles lazily anyway, at the first call;
:func:`compile_on_first_call` does the same without touching TorchDynamo before then, so
each function runs exactly as megatron-core's decoration would run it:
``torch.compile(fn, **its arguments)``, built at the first call.

:func:`install` puts a finder on ``sys.meta_path`` for the ``megatron.core`` package:
while its ``__init__`` (and all it imports) runs, ``torch.compile`` is a lazy stand-in
(:func:`lazy_compile`) for functions; modules, and everything after the import, get
torch's own. ``megatron.core.jit.jit_fuser`` keeps the stand-in it captured.
``megatron_ext/__init__.py`` installs it, so it is in place before anything of this
project imports megatron-core.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
from typing import Callable, Optional

PACKAGE = "megatron.core"


def compile_on_first_call(fn: Callable, compile: Optional[Callable] = None,
                          kwargs: Optional[dict] = None) -> Callable:
    """``compile(fn, **kwargs)`` (torch.compile by default), built at the first call."""
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kw):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = (compile or torch.compile)(fn, **(kwargs or {}))
        return compiled(*args, **kw)

    call.compile_on_first_call = True
    return call


def lazy_compile(real: Callable) -> Callable:
    """A ``torch.compile`` that defers plain functions to their first call.

    Takes the same arguments (``torch.compile(fn, **kw)``, ``@torch.compile``,
    ``@torch.compile(**kw)``); anything but a plain function goes to ``real`` at once.
    """
    def compile(model=None, **kwargs):
        if model is None:
            return lambda fn: compile(fn, **kwargs)
        if not inspect.isfunction(model):
            return real(model, **kwargs)
        return compile_on_first_call(model, real, kwargs)

    compile.lazy_compile = True
    return compile


class _Loader(importlib.abc.Loader):
    """megatron.core's own loader, run with the lazy torch.compile in place."""

    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        import torch

        real = torch.compile
        torch.compile = lazy_compile(real)
        try:
            self.inner.exec_module(module)
        finally:
            torch.compile = real


class _Finder(importlib.abc.MetaPathFinder):
    """Finds megatron.core as the path finder does and wraps its loader."""

    def find_spec(self, name, path=None, target=None):
        if name != PACKAGE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Puts the finder first on ``sys.meta_path`` (once; a no-op once megatron.core is in)."""
    if PACKAGE in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
