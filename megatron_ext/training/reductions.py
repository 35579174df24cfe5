"""The step's reductions over ranks: the loss sums, their means, the parameters' norm."""

from __future__ import annotations

import torch

from megatron_ext.runtime.to_host import ToHost


def _params_norm(model_chunks) -> float:
    """L2 norm of the model's parameters in fp32, over all tensor/pipeline-parallel ranks.

    Each parameter counts once: TP-duplicated ones (norms, biases of row-parallel layers)
    only on TP rank 0, the embedding shared with the output layer only on the first stage.
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.module import param_is_not_shared

    square = None
    for chunk in model_chunks:
        for param in chunk.parameters():
            if not (param_is_not_shared(param)
                    and tensor_parallel.param_is_not_tensor_parallel_duplicate(param)):
                continue
            value = param.detach().float().pow(2).sum()
            square = value if square is None else square + value
    if square is None:
        square = torch.zeros((), device=next(model_chunks[0].parameters()).device)
    square = square.reshape(1)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(square, group=parallel_state.get_model_parallel_group())
    return float(square.sqrt().item())


def _sum_reports(losses_reduced, device) -> torch.Tensor:
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for report in losses_reduced:
        total += report["lm loss"].to(total.dtype)
    return total


def _global_sum(local_sum_count: torch.Tensor) -> ToHost:
    """Sums (loss, tokens) over all ranks; the result on its way to the host.

    Other pipeline stages contribute zeros; TP ranks of the last stage contribute equal
    copies, which leave the ratio unchanged.
    """
    total = local_sum_count.clone()
    torch.distributed.all_reduce(total)
    return ToHost(total)


def _mean(total: ToHost) -> float:
    """Token-weighted mean of a :func:`_global_sum`."""
    loss, tokens = total.get().tolist()
    return loss / tokens if tokens > 0 else float("nan")


def _global_mean(local_sum_count: torch.Tensor) -> float:
    """Token-weighted mean over the data-parallel ranks of the last pipeline stage."""
    return _mean(_global_sum(local_sum_count))
