"""AdamW step and gradient unscale/clip of the optimizers that keep their own states.

The offload engine and ZenFlow share them; both match megatron-core bit for bit. torch
only: engines that import this stay independent of megatron-core.
"""

from __future__ import annotations

import logging

import torch
from torch.optim.adam import adam

from megatron_ext.runtime import host_kernels

log = logging.getLogger(__name__)
_warned = False


def _host_kernel(tensors):
    """The one-pass host AdamW (runtime/host_kernels.py) for these tensors, or None."""
    global _warned
    if not host_kernels.adamw_supports(*tensors):
        return None
    lib = host_kernels.load()
    if lib is None and not _warned:
        _warned = True
        log.warning("the one-pass host AdamW is unavailable (no C compiler?): host Adam "
                    "uses torch's reference AdamW, several times slower (install gcc)")
    return lib


def adam_update(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, step: int, hp: dict, fused: bool = False) -> None:
    """One AdamW step in place (the ``step``-th for these elements).

    CUDA tensors take torch's fused kernel. Host tensors take, with ``fused`` (GPU
    machines, where the CPU side must be fast), the one-pass host AdamW of
    :mod:`megatron_ext.runtime.host_kernels`: as fast as torch's fused CPU kernel, and its
    bits do not depend on how the states are cut into calls (torch's fused CPU kernel's
    do: the same state in other subgroups, or moved by a ZenFlow re-selection, would take
    other bits). It equals torch's reference AdamW to rounding (an IEEE square root).
    Without ``fused``, or where the kernel cannot be built, torch's reference
    implementation, which is what megatron-core's optimizer runs on a CPU-only machine:
    bit for bit the same results there.

    Args:
        master: fp32 master weights, updated in place.
        grad: their fp32 gradients (unscaled and clipped).
        exp_avg: Adam's first moments, updated in place.
        exp_avg_sq: Adam's second moments, updated in place.
        step: the step count of these elements after this step (bias correction).
        hp: the param group's settings (betas, lr, weight_decay, eps).
        fused: the one-pass host kernel for host tensors.
    """
    if master.numel() == 0:
        return
    beta1, beta2 = hp["betas"]
    if fused and not master.is_cuda:
        lib = _host_kernel((master, grad, exp_avg, exp_avg_sq))
        if lib is not None:
            host_kernels.adamw(lib, master, grad, exp_avg, exp_avg_sq, step=step, lr=hp["lr"],
                               beta1=beta1, beta2=beta2, eps=hp["eps"],
                               weight_decay=hp["weight_decay"],
                               threads=torch.get_num_threads())
            return
    # A fresh step tensor: adam() increments it before use, like each parameter's own step
    # in torch's AdamW. The fused CUDA kernel wants it on the device, the CPU paths on the host.
    step_tensor = torch.tensor(float(step - 1), device=master.device if master.is_cuda else None)
    adam([master], [grad], [exp_avg], [exp_avg_sq], [], [step_tensor], foreach=False,
         fused=True if master.is_cuda else None, capturable=False,
         differentiable=False, has_complex=False, amsgrad=False, beta1=beta1, beta2=beta2,
         lr=hp["lr"], weight_decay=hp["weight_decay"], eps=hp["eps"], maximize=False,
         decoupled_weight_decay=True)


def unscale_and_clip(grads: torch.Tensor, inv_scale, clip_coeff) -> torch.Tensor:
    """megatron-core's two multiplications on fp32 grads, in its order: unscale, then clip.

    The same operations in the same order, so the results match its main grads bit for bit.
    """
    if inv_scale is not None:
        grads.mul_(inv_scale.to(grads.device) if torch.is_tensor(inv_scale) else inv_scale)
    if clip_coeff is not None:
        grads.mul_(clip_coeff)
    return grads
