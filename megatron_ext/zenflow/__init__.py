"""ZenFlow selective updates (arXiv 2505.12242) behind ``--zenflow``.

Modules, one per concern: ``config`` (the typed config), ``selection`` (column
importance from the rank's gradient shard, all-reduced as one vector per matrix; top-k;
the gather/scatter plan of selected and delayed columns), ``schedule`` (warm-up, fixed
and auto update interval, re-selection points), ``cpu_worker`` (the asynchronous CPU
side: fp32 accumulation and Adam, double-buffered accumulators), ``optimizer`` (the
megatron-core DistributedOptimizer subclass that the optimizer seam builds).
"""
