"""megatron_ext: GPT pretraining on megatron-core with optimizer-state offload."""

from megatron_ext.runtime import lazy_jit as _lazy_jit

__version__ = "0.1.0"

# Before anything imports megatron-core: its torch.compile'd fusions are built at their
# first call, not at import (runtime/lazy_jit.py: ~4 s of every process's start).
_lazy_jit.install()
