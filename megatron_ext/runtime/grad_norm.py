"""megatron-core's local grad-norm fallback, with one device-to-host copy.

Without Transformer Engine or apex, megatron-core's ``get_grad_norm_fp32`` takes the norm
of its gradients with ``megatron.core.utils.local_multi_tensor_l2_norm``: ``torch.norm`` of
each tensor on the device, then ``torch.tensor(list of those 0-dim device tensors)``, which
copies them to the host one at a time, each copy a synchronization (about 300 per step on
the reference GPT, ~6 us each on an idle host and ~70 us while ZenFlow's host threads
run), and the norm of the norms on the host. :func:`l2_norm` computes the same values the
same way (the same per-tensor op, an exact copy of the norms, the same host-side norm in
the same layout and dtype), with the norms stacked on the device and copied in one
transfer; :func:`install` puts it in place of the fallback (nothing changes where TE or
apex provide their kernel).
"""

from __future__ import annotations

import torch

_original = None


def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for ``local_multi_tensor_l2_norm`` (same signature, same result)."""
    norms = [torch.norm(t) for tensors in tensor_lists for t in tensors]
    width = {len(tensors) for tensors in tensor_lists}
    if (not norms or len(width) != 1 or len({n.dtype for n in norms}) != 1
            or len({n.device for n in norms}) != 1):
        return _original(chunk_size, noop_flag, tensor_lists, per_tensor, *args)
    # torch.tensor(l2) of the fallback: a [lists, width] host tensor of the norms' dtype.
    host = torch.stack(norms).cpu().view(len(tensor_lists), -1)
    reduced = torch.norm(host)
    return torch.tensor([float(reduced)], dtype=torch.float, device="cuda"), None


def install() -> bool:
    """Replaces megatron-core's local fallback in clip_grads; True if it was in use."""
    global _original
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is l2_norm:
        return True
    if clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
        return False
    _original = utils.local_multi_tensor_l2_norm
    clip_grads.l2_norm_impl = l2_norm
    return True
