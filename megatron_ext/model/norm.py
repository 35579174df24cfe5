"""A LayerNorm / RMSNorm for megatron-core's local layer spec, with what torch's lacks.

megatron-core's local spec normalizes with ``WrappedTorchNorm`` (torch.nn.LayerNorm or
RMSNorm) when Apex is missing; it refuses zero-centered weights (Megatron-LM's
``--apply-layernorm-1p``) and sequence parallelism. This module does both: it computes
``(1 + weight) * normalized`` with the weight initialized to 0, and marks its parameters
``sequence_parallel`` so that megatron-core's ``finalize_model_grads`` all-reduces their
gradients over the tensor-parallel ranks (each rank saw only its part of the sequence).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Norm(torch.nn.Module):
    """LayerNorm or RMSNorm (``config.normalization``) with optional zero-centered gamma.

    Args:
        config: megatron-core TransformerConfig (normalization, layernorm_zero_centered_gamma,
            sequence_parallel, params_dtype).
        hidden_size: size of the normalized (last) dimension.
        eps: epsilon of the normalization.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"Norm supports LayerNorm and RMSNorm, not {config.normalization}")
        self.rms = config.normalization == "RMSNorm"
        self.zero_centered = bool(config.layernorm_zero_centered_gamma)
        self.eps = eps
        self.shape = (hidden_size,)
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.bias = (None if self.rms
                     else torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype)))
        for param in self.parameters():
            setattr(param, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalizes the last dimension of ``x``."""
        weight = self.weight + 1 if self.zero_centered else self.weight
        if self.rms:
            return F.rms_norm(x, self.shape, weight, self.eps)
        return F.layer_norm(x, self.shape, weight, self.bias, self.eps)
