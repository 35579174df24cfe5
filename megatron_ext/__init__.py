"""megatron_ext: GPT pretraining on megatron-core with optimizer-state offload."""

__version__ = "0.1.0"
