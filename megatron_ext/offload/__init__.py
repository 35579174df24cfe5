"""The tiered offload engine (MLP-Offload techniques) behind ``--offload-optimizer``.

Modules, one per concern: ``config`` (the engine's typed config), ``tiers`` (tier
specs, bandwidth probe, placement, rebalancing), ``io`` (state files: threaded aligned
I/O, O_DIRECT, checksums, atomic writes), ``locks`` (node-local concurrency control),
``subgroups`` (partition of the rank's optimizer shard), ``cache`` (host cache,
alternating order), ``engine`` (the update pipeline), ``optimizer`` (the megatron-core
DistributedOptimizer subclass that the optimizer seam builds).
"""
