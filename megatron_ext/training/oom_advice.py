"""What to try when a run runs out of memory: the tail of its one-line error.

:func:`oom_advice` names only the flags that would change something for this run (no
``--offload-optimizer`` to a run that has it). What lowers the host memory depends on the
optimizer mode, which says it (``Mode.host_memory_fixes``); the data loaders and the ranks
per node are every run's. :func:`plan_note` is the one place where the memory plan's
estimate of the run joins the line.
"""

from __future__ import annotations

from megatron_ext.optim.modes import mode_of


def plan_note(cfg, kind: str) -> str:
    """The memory plan's words on a shortage of ``kind`` (``device`` or ``host``).

    The plan (megatron_ext/memory/) estimates each tier before the first allocation; its
    estimate for the memory that ran out, and the setting it would pick, belong here.
    Empty until it is wired.
    """
    return ""


def _on_cpu(cfg) -> bool:
    """Whether the run trains on the CPU (its host memory is its device's too)."""
    if cfg.runtime.device != "auto":
        return cfg.runtime.device == "cpu"
    import torch

    return not torch.cuda.is_available()


def _either(tips) -> str:
    if len(tips) == 1:
        return tips[0]
    return ", ".join(tips[:-1]) + ", or " + tips[-1]


def oom_advice(cfg, kind: str) -> str:
    """``try ...``: the flags that would lower the memory that ran out (``device``/``host``)."""
    tips = []
    if kind == "device":
        if not mode_of(cfg).flag:  # the plain optimizer keeps its states on the device
            tips.append("--offload-optimizer (optimizer states off the GPU)")
        if cfg.training.micro_batch_size > 1:
            tips.append("a smaller --micro-batch-size")
        if cfg.model.recompute_granularity != "full":
            tips.append("--recompute-granularity full --recompute-method uniform")
        if cfg.parallel.tensor_model_parallel_size == 1:
            tips.append("--tensor-model-parallel-size 2 or more")
    else:
        on_cpu = _on_cpu(cfg)
        tips += mode_of(cfg).host_memory_fixes(cfg, on_cpu)
        if on_cpu and cfg.training.micro_batch_size > 1:  # the activations are the host's
            tips.append("a smaller --micro-batch-size")
        if cfg.data.num_workers > 0:
            tips.append("fewer --num-workers")
        tips.append("fewer ranks per node")
    text = f"try {_either(tips)}" if tips else ""
    note = plan_note(cfg, kind)
    return f"{text}; {note}" if note and text else (note or text)
