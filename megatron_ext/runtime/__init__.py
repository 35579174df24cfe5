"""Distributed init, device selection, and megatron-core on the CPU."""
