"""megatron-core's ``@jit_fuser`` functions compiled at their first call, not at import.

megatron-core binds ``megatron.core.jit.jit_fuser`` to ``torch.compile`` and decorates
~40 fused functions with it while ``import megatron.core`` runs. Each decoration imports
and configures TorchDynamo and Inductor: about 4 s of a 10 s start on a CPU machine,
paid by every process (every rank, every tool that imports megatron-core) whether or not
one of those functions ever runs (on the CPU none does). ``torch.compile`` compiles
lazily anyway, at the first call; :func:`compile_on_first_call` does the same without
touching TorchDynamo before then. Each function then runs exactly as megatron-core's own
decoration would run it: ``torch.compile(fn)`` with the defaults, built at the first call.

:func:`install` puts a finder on ``sys.meta_path`` that, once ``megatron.core.jit`` has
run, swaps its ``jit_fuser`` for :func:`compile_on_first_call` when it is still
``torch.compile`` (megatron-core's ``disable_jit_fuser``/``enable_jit_fuser`` keep working
for modules imported after them). ``megatron_ext/__init__.py`` installs it, so it is in
place before anything of this project imports megatron-core.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Callable

MODULE = "megatron.core.jit"


def compile_on_first_call(fn: Callable) -> Callable:
    """``torch.compile(fn)``, built at the first call instead of now."""
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    call.compile_on_first_call = True
    return call


class _Loader(importlib.abc.Loader):
    """megatron.core.jit's own loader, then the swap."""

    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        torch = sys.modules.get("torch")
        if torch is not None and getattr(module, "jit_fuser", None) is torch.compile:
            module.jit_fuser = compile_on_first_call


class _Finder(importlib.abc.MetaPathFinder):
    """Finds megatron.core.jit as the path finder does and wraps its loader."""

    def find_spec(self, name, path=None, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Puts the finder first on ``sys.meta_path`` (once; a no-op once the module is imported)."""
    if MODULE in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
