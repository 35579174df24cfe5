"""ZenFlow selective updates (arXiv 2505.12242) behind ``--zenflow``.

Modules, one per concern: ``config`` (the typed config and its knobs), ``selection``
(column importance from the rank's gradient shard, all-reduced as one vector per matrix;
top-k; the gather/scatter plan of selected and delayed columns), ``schedule`` (warm-up,
fixed and auto update interval, re-selection points), ``accumulation`` (where the delayed
grads are summed; the device-side sum), ``engine`` (the step, as named phases),
``transfers`` (delayed grads to the host, staging, the new weights' uploads), ``moves``
(states changing sides at re-selection), ``metrics`` (the engine's counters),
``cpu_worker`` (the asynchronous CPU side: fp32 accumulation and Adam threads,
double-buffered accumulators), ``cpu_states`` (where the CPU side keeps its fp32 masters
and moments: host memory or the offload tiers), ``cpu_affinity`` (the CPU side's CPUs and
threads), ``optimizer`` (the megatron-core DistributedOptimizer subclass that the
optimizer seam builds).
"""
