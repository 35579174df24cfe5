"""fp32 masters into and out of a subgroup's state, whole or as remainders. Pure torch.

What the engine's initialization, reads and checkpoint conversions share: a state's views
(:meth:`~.states.StateLayout.views`) hold the master whole, or as the remainder that
:mod:`.remainders` completes with the bf16 weights. The update's own path (decode, Adam,
encode) is :class:`~.updaters.SubgroupAdam`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_ext.offload.remainders import decode, encode, sign_bits
from megatron_ext.offload.states import StateLayout


def store_masters(layout: StateLayout, views: Sequence[torch.Tensor], master: torch.Tensor,
                  params_out: Optional[torch.Tensor]) -> None:
    """Puts fp32 ``master`` into a state whose moments are already in ``views``.

    With remainders the bf16 weights that complete them go into ``params_out`` (torch's
    cast of ``master``); without, ``params_out`` is not used.
    """
    if layout.remainders:
        encode(master, views[0], sign_bits(views[2]), params_out)
    else:
        views[0].copy_(master)


def read_masters(layout: StateLayout, views: Sequence[torch.Tensor], start: int, length: int,
                 params: Optional[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
    """Elements ``[start, start + length)`` of a state, in fp32 semantics, into ``outs``.

    The master whole (rebuilt from ``params``, that range's bf16 weights, with
    remainders), exp_avg and exp_avg_sq (without the bit remainders keep in its sign);
    the state is left as it is.
    """
    span = slice(start, start + length)
    if not layout.remainders:
        for view, out in zip(views, outs):
            out.copy_(view[span])
        return
    v = views[2][span].clone()
    master = torch.empty(length, dtype=torch.float32, device=v.device)
    decode(params.to(v.device), views[0][span], sign_bits(v), master)
    for value, out in zip((master, views[1][span], v), outs):
        out.copy_(value)


def convert(source: StateLayout, src: Sequence[torch.Tensor], target: StateLayout,
            dst: Sequence[torch.Tensor], params: torch.Tensor) -> Optional[torch.Tensor]:
    """A state of layout ``source`` into one of layout ``target`` (same dtypes otherwise).

    Whole masters become remainders or the reverse; ``params`` are the subgroup's bf16
    weights (contiguous, the state's device).

    Returns:
        None, or, when whole masters became remainders, the weights those remainders
        need (torch's cast of the masters): the caller checks or sets ``params`` with them.
    """
    for s, d in zip(src[1:], dst[1:]):
        d.copy_(s)
    if source.remainders == target.remainders:
        dst[0].copy_(src[0])
        return None
    if source.remainders:
        decode(params, src[0], sign_bits(dst[2]), dst[0])
        return None
    needed = torch.empty_like(params)
    encode(src[0], dst[0], sign_bits(dst[2]), needed)
    return needed

