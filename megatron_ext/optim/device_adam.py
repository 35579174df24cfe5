"""The device tier's AdamW with remainders in one pass over memory (a Triton kernel).

The torch path of a device-tier subgroup with remainders (bf16 weights, fp32 masters kept
as 16-bit remainders, fp32 moments: 10 bytes per element) gathers the gradients and the
weights, decodes the masters, runs torch's fused AdamW, encodes the masters and scatters
the weights: about fifteen passes over memory. :func:`adamw_remainders` reads each
element's bf16 weight and gradient, remainder and both moments once and writes the
weight, remainder and moments once, straight from and into the model's buffers (one
launch per piece of a subgroup). Its arithmetic is the host kernel's
(``csrc/host_kernels.c``: IEEE fp32 operations, fused multiply-adds where torch's
reference AdamW has them, nothing else contracted), so the device tier and the host
update the same states to the same bits.

The default on CUDA since its GPU test and benchmark ran (tests/gpu/test_gpu_device_adam.py
on megatron-core 0.19.2 and 0.16.1; ``bench/gpu/device_adam_bench.py``: 2.44 ms against
torch's 14.42 ms for 2^28 elements on an H100, bench/results/2026-12-07-h100-device-adam).
``MEGATRON_EXT_DEVICE_ADAM=torch`` keeps torch's path. Without Triton or CUDA the torch path
is used whatever the variable says.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

DEVICE_ADAM_ENV = "MEGATRON_EXT_DEVICE_ADAM"
CHOICES = ("torch", "fused")

try:  # Triton comes with torch's CUDA builds; CPU machines may not have it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None


def choice() -> str:
    """The device Adam the environment asks for (``fused`` unless set)."""
    value = os.environ.get(DEVICE_ADAM_ENV, "fused").strip().lower() or "fused"
    if value not in CHOICES:
        from megatron_ext.errors import UsageError

        raise UsageError(f"{DEVICE_ADAM_ENV}={value!r}: use one of {', '.join(CHOICES)}")
    return value


def available(device: torch.device) -> bool:
    """Whether the kernel can run for tensors on ``device`` (Triton and a CUDA device, or
    Triton's interpreter, ``TRITON_INTERPRET=1``, for any device)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def enabled(device: torch.device) -> bool:
    """Whether the device tier of this run takes the one-pass kernel."""
    return choice() == "fused" and available(device)


if triton is not None:

    @triton.jit
    def _adamw_remainders_kernel(w_ptr, g_ptr, rem_ptr, m_ptr, v_ptr, inv_ptr, n, c_wd, coeff,
                                 s2, b2, bc2s, eps, neg_step, clip, SMALL: tl.constexpr,
                                 HAS_INV: tl.constexpr, HAS_CLIP: tl.constexpr,
                                 BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        w_bits = tl.load(w_ptr + offsets, mask=mask, other=0)  # bf16 weights' int16 bits
        rem = tl.load(rem_ptr + offsets, mask=mask, other=0)  # int16 remainders
        v_bits = tl.load(v_ptr + offsets, mask=mask, other=0)  # exp_avg_sq's int32 bits
        m = tl.load(m_ptr + offsets, mask=mask, other=0.0)
        g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_INV:
            g = g * tl.load(inv_ptr)
        if HAS_CLIP:
            g = g * clip
        # Decode (remainders.decode): high = p - up, master = high:rem; v without the bit.
        up = (v_bits < 0).to(tl.int16)
        high = (w_bits - up).to(tl.int16)
        master = ((high.to(tl.int32) << 16) | (rem.to(tl.int32) & 0xFFFF)).to(
            tl.float32, bitcast=True)
        v = (v_bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
        # AdamW, the host kernel's operations.
        if SMALL:
            m = tl.math.fma(coeff, g - m, m)
        else:
            m = tl.math.fma(coeff, g - m, g)
        v = tl.math.fma(s2 * g, g, v * b2)
        den = tl.math.div_rn(tl.math.sqrt_rn(v), bc2s) + eps
        master = master * c_wd + tl.math.div_rn(neg_step * m, den)
        # Encode (remainders.encode): the RNE cast, the low half, up = high half != cast.
        p_bits = master.to(tl.bfloat16).to(tl.int16, bitcast=True)
        master_bits = master.to(tl.int32, bitcast=True)
        up_new = ((master_bits >> 16).to(tl.int16) != p_bits).to(tl.int32)
        v_new = v.to(tl.int32, bitcast=True) | (up_new << 31)
        tl.store(w_ptr + offsets, p_bits, mask=mask)
        tl.store(rem_ptr + offsets, master_bits.to(tl.int16), mask=mask)
        tl.store(m_ptr + offsets, m, mask=mask)
        tl.store(v_ptr + offsets, v_new, mask=mask)


BLOCK = 1024


def adamw_remainders(weights: torch.Tensor, grads: torch.Tensor, rem: torch.Tensor,
                     exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, step: int, hp: dict,
                     inv_scale: Optional[torch.Tensor], clip_coeff: Optional[float]) -> None:
    """One AdamW step of ``n`` elements in place, queued on the current stream.

    Args:
        weights: the bf16 weights (the model's buffer), read and written.
        grads: their gradients in the training dtype (bf16, fp16 or fp32), read.
        rem: the masters' int16 remainders, read and written.
        exp_avg: fp32 first moments, read and written.
        exp_avg_sq: fp32 second moments whose sign bits complete the masters.
        step: the Adam step after this one (bias correction).
        hp: the param group's settings (lr, betas, eps, weight_decay).
        inv_scale: fp16's loss-scale inverse, a one-element fp32 tensor on the device, or
            None.
        clip_coeff: the clipping factor (< 1) or None.
    """
    n = weights.numel()
    if n == 0:
        return
    lr, (beta1, beta2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    w1 = 1 - beta1
    small = -0.5 < w1 < 0.5
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731 (fp32 rounding)
    coeff = f32(w1) if small else f32(f32(w1) - 1.0)
    inv = inv_scale if inv_scale is not None else exp_avg  # any pointer: not read
    _adamw_remainders_kernel[(triton.cdiv(n, BLOCK),)](
        weights.view(torch.int16), grads, rem, exp_avg, exp_avg_sq.view(torch.int32), inv, n,
        f32(1 - lr * wd), coeff, f32(1 - beta2), f32(beta2), f32(bias_correction2 ** 0.5),
        f32(eps), f32(-(lr / bias_correction1)),
        f32(clip_coeff) if clip_coeff is not None else 1.0, SMALL=small,
        HAS_INV=inv_scale is not None, HAS_CLIP=clip_coeff is not None, BLOCK=BLOCK,
        num_warps=4, enable_fp_fusion=False)
