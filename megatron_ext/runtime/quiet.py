"""Silencing the import-time warnings of megatron-core's optional dependencies."""

import warnings


def quiet_optional_dependencies() -> None:
    """megatron-core warns at import about every optional package it falls back from."""
    for pattern in (".*Apex is not installed.*", ".*Transformer Engine.*",
                    ".*transformer_engine.*", ".*nvidia-modelopt.*", ".*flattened_range.*",
                    ".*full scope is deprecated.*", ".*is not a leaf Tensor is being accessed.*",
                    r".*`torch\.distributed\.\w+` is deprecated.*",
                    ".*`load_state_dict` is deprecated.*", ".*deprecating ShardedTensor.*"):
        warnings.filterwarnings("ignore", message=pattern)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
