"""fp32 masters kept as 16-bit remainders beside the bf16 parameters, exactly. Pure torch.

With bf16 parameters the top 16 bits of an fp32 master are nearly the parameter itself, so
a state can keep only the low 16 bits of the master (the *remainder*, megatron-core's
``store_param_remainders``) and rebuild the master from the parameter: 2 bytes per element
instead of 4. The parameter here is torch's cast, round-to-nearest-even (RNE), so that runs
stay bit for bit equal to full fp32 masters and to megatron-core's own optimizer. RNE
loses one bit: the cast either kept the master's top half (``p == high``) or rounded it up
by one unit in the last place (``p == high + 1``, as unsigned 16-bit patterns, for either
sign). That bit, ``up``, is kept in the sign bit of ``exp_avg_sq``, which Adam never sets
(``v >= 0``, never ``-0.0``: it starts at +0 and only adds squares). Transformer Engine
avoids the extra bit by rounding ties away from zero instead, which makes its parameters
differ from torch's cast; this module keeps torch's cast on purpose.

Per element, with ``p`` the bf16 parameter's bits and ``m`` the fp32 master's (as two
int16 halves, little-endian: ``[0::2]`` low, ``[1::2]`` high)::

    encode:  p = bf16(m) (torch's cast)   rem = low(m)   up = high(m) != p
    decode:  high = p - up (16-bit wrap)  m = high:rem  (then v's sign bit is cleared)

A finite master always decodes exactly; a NaN master does not (torch's cast makes every NaN
the same bf16 NaN), nor does anything after a NaN, which a run does not survive anyway.
Every function is plain torch on the tensors' own device: no host synchronization.
"""

from __future__ import annotations

import sys

import torch

if sys.byteorder != "little":  # the int16 halves of an fp32 below are little-endian
    raise ImportError("megatron_ext.offload.remainders needs a little-endian machine")

_SIGN_VIEW = {4: torch.int32, 2: torch.int16}
_MAGNITUDE = {torch.int32: 0x7FFFFFFF, torch.int16: 0x7FFF}
_SIGN_SHIFT = {torch.int32: 31, torch.int16: 15}


def sign_bits(exp_avg_sq: torch.Tensor) -> torch.Tensor:
    """``exp_avg_sq`` (fp32, bf16 or fp16) as signed integers of its width: the bit view."""
    return exp_avg_sq.view(_SIGN_VIEW[exp_avg_sq.element_size()])


def decode(params: torch.Tensor, rem: torch.Tensor, v_bits: torch.Tensor,
           out: torch.Tensor) -> torch.Tensor:
    """The fp32 masters into ``out``; clears the ``up`` bits in ``exp_avg_sq``.

    Args:
        params: the bf16 parameters (any 16-bit tensor of their bits), ``n`` elements.
        rem: the int16 remainders, ``n`` elements.
        v_bits: ``exp_avg_sq``'s bit view (:func:`sign_bits`), ``n`` elements; its sign
            bits are cleared in place (Adam then sees the true ``v``).
        out: contiguous fp32, ``n`` elements: the masters.

    Returns:
        ``out``.
    """
    halves = out.view(torch.int16)
    halves[0::2].copy_(rem)
    high = halves[1::2]
    high.copy_(params.view(torch.int16))
    # p - up, wrapping at 16 bits (never reached for a finite master).
    high.sub_((v_bits < 0).to(torch.int16))
    v_bits.bitwise_and_(_MAGNITUDE[v_bits.dtype])
    return out


def encode(master: torch.Tensor, rem: torch.Tensor, v_bits: torch.Tensor,
           params_out: torch.Tensor) -> torch.Tensor:
    """Splits fp32 ``master`` into the bf16 parameters, the remainders and ``up`` bits.

    Args:
        master: contiguous fp32 masters, ``n`` elements (read only).
        rem: where the int16 remainders go.
        v_bits: ``exp_avg_sq``'s bit view (:func:`sign_bits`): its sign bits become the
            ``up`` bits (its values must be ``>= 0``, as Adam keeps them).
        params_out: where the new bf16 parameters go (torch's cast of the masters).

    Returns:
        ``params_out``.
    """
    params_out.copy_(master)
    halves = master.view(torch.int16)
    rem.copy_(halves[0::2])
    up = halves[1::2] != params_out.view(torch.int16)
    v_bits.bitwise_and_(_MAGNITUDE[v_bits.dtype])
    v_bits.bitwise_or_(up.to(v_bits.dtype).bitwise_left_shift_(_SIGN_SHIFT[v_bits.dtype]))
    return params_out

