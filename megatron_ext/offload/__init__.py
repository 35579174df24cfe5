"""The tiered offload engine (MLP-Offload techniques) behind ``--offload-optimizer``.

Modules, one per concern: ``config`` (the engine's typed config), ``paths`` (tier
specs, free space), ``probe`` (the paths' bandwidth probe, through ``io``), ``placement``
(placement on the paths, rebalancing), ``tier_model`` (where a subgroup lives, who
updates it), ``io`` (state files: threaded aligned I/O, O_DIRECT, checksums, atomic
writes), ``locks`` (node-local concurrency control), ``subgroups`` (partition of the
rank's optimizer shard), ``cache`` (host cache, alternating order), ``engine`` (the update
pipeline), ``optimizer`` (the megatron-core DistributedOptimizer subclass that the
optimizer seam builds).
"""
