"""The memory plan at start-up: made before the datasets and the model, logged, enforced."""

from __future__ import annotations

import logging
from typing import Optional, Tuple

from megatron_ext.errors import UsageError
from megatron_ext.memory.machine import Machine, measure
from megatron_ext.memory.plan import MemoryPlan, plan_run
from megatron_ext.memory.report import plan_table
from megatron_ext.optim.modes import mode_of

log = logging.getLogger("megatron_ext")


def settle_plan(cfg, vocab_size: int, world_size: int,
                machine: Machine) -> Tuple[MemoryPlan, Optional[str]]:
    """The run's plan, after the mode re-settled its own ``auto`` choices to fit.

    Where the first plan refuses the run, the mode may change one of the choices it made by
    itself (``Mode.refit``: ZenFlow's CPU-side states from host memory to the offload
    engine's host cache); the change stays, and ``cfg`` keeps it, only if the second plan
    fits. Returns (the plan, the line saying what changed; None when nothing did).
    """
    plan = plan_run(cfg, vocab_size, world_size, machine)
    refit = mode_of(cfg).refit(cfg, plan) if plan.refusals else None
    if refit is None:
        return plan, None
    note, undo = refit
    second = plan_run(cfg, vocab_size, world_size, machine)
    if second.refusals:
        undo()
        return plan, None
    return second, note


def plan_before_start(cfg, runtime, vocab_size: int) -> MemoryPlan:
    """Measures this machine, makes the run's plan, logs its table, refuses what cannot fit.

    Args:
        cfg: the run's config (settled: checkpoint args taken); the mode's ``auto``
            choices may be re-settled (:func:`settle_plan`).
        runtime: this rank's runtime.
        vocab_size: the tokenizer's vocabulary (before padding).

    Raises:
        UsageError: the plan's first refusal, unless ``--no-plan-check``.
    """
    # The paths' speeds first (probed where not given): the plan places with them, and the
    # engine, reading them back from cfg, places the same way without probing again.
    mode_of(cfg).measure_tiers(cfg, runtime)
    plan, note = settle_plan(cfg, vocab_size, runtime.world_size, measure(cfg, runtime))
    if note:
        log.info("%s", note)
    log.info("%s", plan_table(plan))
    if plan.refusals:
        if cfg.plan.plan_check:
            raise UsageError(f"memory plan: {plan.refusals[0]}")
        log.warning("memory plan: %s (--no-plan-check: starting anyway)", plan.refusals[0])
    return plan
