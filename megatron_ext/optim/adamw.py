"""AdamW step and gradient unscale/clip of the optimizers that keep their own states.

The offload engine and ZenFlow share them; both match megatron-core bit for bit. torch
only: engines that import this stay independent of megatron-core.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam


def adam_update(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, step: int, hp: dict, fused: bool = False) -> None:
    """One AdamW step in place (the ``step``-th for these elements), torch's implementation.

    CUDA tensors always take the fused kernel. Host tensors take torch's fused CPU kernel
    when ``fused`` (GPU machines, where the CPU side must be fast; its rounding differs from
    the reference implementation in the last bit), else the reference implementation, which
    is what megatron-core's optimizer runs on a CPU-only machine: bit for bit the same
    results there.

    Args:
        master: fp32 master weights, updated in place.
        grad: their fp32 gradients (unscaled and clipped).
        exp_avg: Adam's first moments, updated in place.
        exp_avg_sq: Adam's second moments, updated in place.
        step: the step count of these elements after this step (bias correction).
        hp: the param group's settings (betas, lr, weight_decay, eps).
        fused: torch's fused kernel for host tensors too.
    """
    if master.numel() == 0:
        return
    beta1, beta2 = hp["betas"]
    # A fresh step tensor: adam() increments it before use, like each parameter's own step
    # in torch's AdamW. The fused CUDA kernel wants it on the device, the CPU paths on the host.
    step_tensor = torch.tensor(float(step - 1), device=master.device if master.is_cuda else None)
    adam([master], [grad], [exp_avg], [exp_avg_sq], [], [step_tensor], foreach=False,
         fused=True if (master.is_cuda or fused) else None, capturable=False,
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
