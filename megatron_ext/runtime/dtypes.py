"""Megatron-LM's dtype names (``--main-params-dtype fp32`` ...) and their torch dtypes."""

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
"""Megatron-LM's names of the state dtypes, as the precision-aware flags spell them."""
