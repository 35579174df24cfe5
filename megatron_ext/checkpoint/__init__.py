"""Checkpoints: save and load in Megatron-LM's layout, integrity, checkpoint args.

Also the standalone reader the tools use without the trainer.
"""
