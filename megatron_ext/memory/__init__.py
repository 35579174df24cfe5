"""The memory plan: how many bytes go where before the first step, and whether they fit.

``shape`` (the model's numbers), ``machine`` (capacities, measured or stated), ``plan``
(per tier bytes and subgroups, the step time, the refusals), ``report`` (the table and the
``memory/plan_*`` metrics), ``startup`` (the trainer's one call), ``config`` (the
``--plan-*`` flags and the machine's test knobs). Planning only: imports the config, the
runtime floor and the mode registry, never an engine; no torch outside ``machine.measure``
on a GPU. See docs/memory.md.
"""
