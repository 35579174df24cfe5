"""Tokenizers and GPT datasets."""
