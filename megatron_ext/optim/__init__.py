"""What the engines share: Adam kernels, the sharded-state optimizer base, the mode registry."""
