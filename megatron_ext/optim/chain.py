"""What the loop and the checkpoint ask of a (chained) megatron-core optimizer.

Optimizers that keep state or threads of their own (the offload engine's, ZenFlow's) answer
through these methods; plain megatron-core optimizers have none of them.
"""

from __future__ import annotations

import torch


def _chain(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def inner_torch_optimizers(optimizer):
    """The torch optimizers inside a (chained) megatron-core optimizer.

    Optimizers that keep their states themselves (``owns_optimizer_states``, e.g. the
    offload engine's) are left out: their torch optimizer only holds the param groups.
    """
    inner = []
    for opt in _chain(optimizer):
        if getattr(opt, "owns_optimizer_states", False):
            continue
        torch_opt = getattr(opt, "optimizer", None)
        if isinstance(torch_opt, torch.optim.Optimizer):
            inner.append(torch_opt)
    return inner


def save_external_state(optimizer, checkpoint_dir: str) -> None:
    """Lets optimizers that keep state outside dist_checkpointing write it (offload files)."""
    for opt in _chain(optimizer):
        if hasattr(opt, "save_external_state"):
            opt.save_external_state(checkpoint_dir)


def load_external_state(optimizer, checkpoint_dir: str) -> None:
    """Restores what :func:`save_external_state` wrote."""
    for opt in _chain(optimizer):
        if hasattr(opt, "load_external_state"):
            opt.load_external_state(checkpoint_dir)


def optimizer_metrics(optimizer) -> dict:
    """Per-iteration metrics the optimizer reports itself (e.g. ``offload/*``), then reset."""
    record = {}
    for opt in _chain(optimizer):
        if hasattr(opt, "metrics"):
            record.update(opt.metrics())
    return record


def close_optimizer(optimizer) -> None:
    """Stops optimizer threads and removes temporary state (offload tier files)."""
    for opt in _chain(optimizer):
        if hasattr(opt, "close"):
            opt.close()
