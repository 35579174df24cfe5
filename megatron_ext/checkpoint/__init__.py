"""Checkpoints: save and load in Megatron-LM's layout, integrity, checkpoint args, the reader
the tools use without the trainer."""
