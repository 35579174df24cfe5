"""The GPT model: megatron-core GPTModel built from the run's config."""

from megatron_ext.model.build import build_model, padded_vocab_size, transformer_config

__all__ = ["build_model", "padded_vocab_size", "transformer_config"]
