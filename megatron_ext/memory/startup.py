"""The memory plan at start-up: made before the datasets and the model, logged, enforced."""

from __future__ import annotations

import logging

from megatron_ext.errors import UsageError
from megatron_ext.memory.machine import measure
from megatron_ext.memory.plan import MemoryPlan, plan_run
from megatron_ext.memory.report import plan_table

log = logging.getLogger("megatron_ext")


def plan_before_start(cfg, runtime, vocab_size: int) -> MemoryPlan:
    """Measures this machine, makes the run's plan, logs its table, refuses what cannot fit.

    Args:
        cfg: the run's config (settled: checkpoint args taken).
        runtime: this rank's runtime.
        vocab_size: the tokenizer's vocabulary (before padding).

    Raises:
        UsageError: the plan's first refusal, unless ``--no-plan-check``.
    """
    plan = plan_run(cfg, vocab_size, runtime.world_size, measure(cfg, runtime))
    log.info("%s", plan_table(plan))
    if plan.refusals:
        if cfg.plan.plan_check:
            raise UsageError(f"memory plan: {plan.refusals[0]}")
        log.warning("memory plan: %s (--no-plan-check: starting anyway)",
                    "; ".join(plan.refusals))
    return plan
