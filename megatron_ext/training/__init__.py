"""The training loop and what it is made of: optimizer seam, checkpoints, metrics."""
