"""The tiered offload engine (MLP-Offload techniques) behind ``--offload-optimizer``.

Modules, one per concern: ``config`` (the engine's typed config and knobs), ``paths`` (tier
specs, free space), ``probe`` (the paths' bandwidth probe, through ``io``), ``placement``
(placement on the paths, rebalancing), ``tier_model`` (where a subgroup lives, who updates
it), ``io`` (state files: threaded aligned I/O, O_DIRECT, checksums, atomic writes),
``locks`` (node-local concurrency control), ``jobdir`` (the job directories), ``subgroups``
(partition of the rank's optimizer shard, ShardParam), ``cache`` (host cache, alternating order),
``plan`` (capacities, placement, the device tier: where each subgroup lives and who updates
it), ``store`` (the subgroups' bytes: files, buffers, fetch and flush), ``updaters`` (CPU,
device and streamed Adam, the gradient sources), ``checkpoint`` (save, load and the
manifest's schema), ``engine`` (the update pipeline that runs them), ``optimizer`` (the
megatron-core DistributedOptimizer subclass that the optimizer seam builds).
"""
