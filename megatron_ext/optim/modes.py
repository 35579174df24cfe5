"""Optimizer modes: each one's flag, rules, optimizer, log line and checkpoint files in one place.

A mode is how the run's optimizer keeps its states: megatron-core's own optimizer (the
plain mode, with megatron-core's ``--optimizer-cpu-offload``), the offload engine's
(``--offload-optimizer``, :mod:`megatron_ext.offload.mode`) or ZenFlow's (``--zenflow``,
:mod:`megatron_ext.zenflow.mode`). Each is one :class:`Mode` object in the registry here;
the config checks its :attr:`Mode.requirements`, the optimizer seam calls its
:meth:`Mode.build`, the stdout line asks its :meth:`Mode.log_summary`, the checkpoint
integrity check its :meth:`Mode.checkpoint_problems`, the checkpoint load its
:attr:`Mode.words` and the memory plan its :meth:`Mode.memory_needs`. None of those name a
mode.

The registry is complete whenever it is asked: the first lookup imports the built-in mode
modules by name (:data:`BUILTIN_MODULES`), so tools that never build a trainer (the
checkpoint checks) see every mode too. That is an arrow back up the package layers
(``optim`` -> ``offload``, ``zenflow``), taken on purpose: the modes are registered objects
that live with their engines, and every question about a mode goes through this registry;
the import is by name, at the first lookup, never at import time. This module and the mode
modules import nothing heavy (torch and megatron-core are imported inside ``build``), so
the config and the tools stay fast.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from megatron_ext.errors import UsageError

BUILTIN_MODULES = ("megatron_ext.offload.mode", "megatron_ext.zenflow.mode")
"""The modules of the built-in modes (each registers its mode when imported)."""


def setting(cfg, path: str) -> Any:
    """``cfg.<section>.<field>`` of a RunConfig or of its ``to_dict()`` (a saved config).

    ``path`` is "section.field"; a section or field that a saved config lacks reads as None.
    """
    node = cfg
    for key in path.split("."):
        node = node.get(key) if isinstance(node, dict) else getattr(node, key, None)
        if node is None:
            return None
    return node


@dataclasses.dataclass(frozen=True)
class Requirement:
    """A rule a mode puts on the other flags: one UsageError line when it is broken.

    Attributes:
        message: the error line, word for word.
        violated: whether a RunConfig breaks the rule.
        when: a flag ("section.field"): the rule applies only while it is set (None: always
            while the mode is enabled).
    """

    message: str
    violated: Callable[[Any], bool]
    when: Optional[str] = None

    def check(self, cfg) -> None:
        """Raises the rule's UsageError when ``cfg`` breaks it."""
        if (self.when is None or setting(cfg, self.when)) and self.violated(cfg):
            raise UsageError(self.message)


def needs(path: str, message: str, when: Optional[str] = None) -> Requirement:
    """The flag at ``path`` must be set."""
    return Requirement(message, lambda cfg: not setting(cfg, path), when)


def refuses(path: str, message: str, when: Optional[str] = None) -> Requirement:
    """The flag at ``path`` must not be set."""
    return Requirement(message, lambda cfg: bool(setting(cfg, path)), when)


def only(path: str, value: Any, message: str, when: Optional[str] = None) -> Requirement:
    """The setting at ``path`` must be ``value``."""
    return Requirement(message, lambda cfg: setting(cfg, path) != value, when)


def metric_section(record: dict, prefix: str,
                   fields: Sequence[Tuple[str, str, str]]) -> Optional[str]:
    """``"PREFIX: label value ..."`` of the ``PREFIX/metric`` values the record has. Pure.

    ``fields``: (metric, label, format spec) each; the spec "ms" shows seconds in
    milliseconds. None when the record has none of them.
    """
    shown = []
    for metric, label, spec in fields:
        value = record.get(f"{prefix}/{metric}")
        if value is None:
            continue
        text = f"{value * 1000:.1f}" if spec == "ms" else format(value, spec)
        shown.append(f"{label} {text}")
    return f"{prefix}: " + " ".join(shown) if shown else None


@dataclasses.dataclass(frozen=True)
class TieredStates:
    """Optimizer states the memory plan places over the device tier, the host and the paths.

    Placement is by subgroup, as the offload engine's: the device tier first (up to its
    bytes), the host next, the ``--offload-paths`` the rest.

    Attributes:
        elements: elements of the rank's states.
        arrays: bytes per element of each stored array (master, exp_avg, exp_avg_sq).
        subgroup_size: elements per subgroup (the unit of placement).
        device_bytes: bytes the device tier may take: None for auto (the plan's device
            budget), 0 for no device tier.
        host_bytes: bytes of host memory for them: None for auto (what the host has left),
            0 for no host cache (the pipeline's buffers only: every state on the paths).
        updates_per_iteration: how often they are all updated (1 every iteration; 1/S
            for a window of S iterations).
        overlaps_compute: whether their update runs beside forward and backward (ZenFlow's
            asynchronous CPU side) rather than after them.
        path_reserve_bytes: free space each path keeps beside the states (spare files).
        place: the mode's placement over the paths: (subgroup bytes, path weights, free
            bytes per path) -> the path of each subgroup; raises a ValueError or a
            UsageError when they do not fit. Required: the plan places the subgroups by
            the rule the engine will use (the offload engine's ``place_subgroups``,
            ``offload/mode.py::path_placement``), never by a second copy of it.
        fix: what else helps when the tiers cannot hold them.
    """

    elements: int
    arrays: Tuple[int, int, int]
    subgroup_size: int
    device_bytes: Optional[int] = 0
    host_bytes: Optional[int] = None
    updates_per_iteration: float = 1.0
    overlaps_compute: bool = False
    path_reserve_bytes: int = 0
    place: Callable[[List[int], List[float], List[int]], List[int]] = dataclasses.field(
        kw_only=True)
    fix: str = ""


@dataclasses.dataclass(frozen=True)
class MemoryNeeds:
    """What a mode keeps where, per rank, beyond the model's weights, grads and activations.

    The memory plan's question to the mode (:meth:`Mode.memory_needs`).

    Attributes:
        gpu: GPU bytes by item ("optimizer states", "staging", ...).
        host: host bytes by item.
        tiered: states the plan places over the tiers (None: none).
        gpu_fix: the flag that moves the GPU items elsewhere, for the refusal line.
        host_fix: the flag that moves the host items elsewhere.
        host_reserve: whether the host items must leave the node's reserve free beside
            them (the offload engine's rule: ``--offload-host-reserve-gb``, else a tenth of
            MemAvailable): so for buffers the process allocates whole, whose excess the
            kernel's OOM killer would meet instead of a cache that sizes itself.
    """

    gpu: Dict[str, int] = dataclasses.field(default_factory=dict)
    host: Dict[str, int] = dataclasses.field(default_factory=dict)
    tiered: Optional[TieredStates] = None
    gpu_fix: str = ""
    host_fix: str = ""
    host_reserve: bool = False


def torch_adam_is_megatrons() -> bool:
    """Whether megatron-core's Adam is torch's AdamW here (no Transformer Engine or apex).

    megatron-core takes TE's FusedAdam, else apex's, else torch's AdamW: the plan asks the
    installation without importing any of them.
    """
    import importlib.util

    return not any(importlib.util.find_spec(name) for name in ("transformer_engine", "apex"))


STEP_ITEM = "optimizer step beyond the activations"


def megatron_step_bytes(cfg, shape) -> Dict[str, int]:
    """GPU bytes megatron-core's optimizer step needs beyond the memory activations free.

    * fp32 gradient copies: with bf16/fp16 gradients (``--grad-reduce-in-bf16``, fp16),
      ``_copy_model_grads_to_main_grads`` makes each shard gradient's fp32 copy and keeps
      them all until the step ends (fp32 gradients are used as they are), 4 bytes per
      element;
    * the step's temporaries: torch's AdamW on CUDA (foreach) takes the square root of
      every second moment of a param group into new tensors at once, 4 bytes per element
      (TE's and apex's fused kernels take none).

    Both live during the step only (the next iteration's ``zero_grad`` drops the copies
    before its forward), when the activations are gone: the peak is the larger of the two
    phases, so what counts is their excess over the activation estimate. Megatron-LM's
    Llama-3-8B flag set on one H200 (8.0B elements) ran out of memory in its first step
    where a plan without them said 142 of 150 GB.
    """
    from megatron_ext.memory.shape import grads_in_fp32

    n = shape.shard_elements
    step = 0
    if shape.param_bytes < 4 and not grads_in_fp32(cfg):
        step += 4 * n
    if cfg.optimizer.optimizer == "adam" and torch_adam_is_megatrons():
        step += 4 * n
    excess = step - shape.activation_bytes
    return {STEP_ITEM: excess} if excess > 0 else {}


def megatron_state_bytes(cfg, shape) -> Tuple[int, int]:
    """(masters, moments) bytes per element of megatron-core's optimizer shard.

    fp32 masters beside bf16/fp16 weights (fp32 weights are their own masters), Adam's two
    fp32 moments (SGD's one momentum buffer).
    """
    masters = 4 if shape.param_bytes < 4 else 0
    moments = 8 if cfg.optimizer.optimizer == "adam" else 4
    return masters, moments


class Mode:
    """One optimizer mode. Subclasses set the attributes and override what differs.

    Attributes:
        name: short identifier ("offload", "zenflow").
        flag: the switch on the command line ("--offload-optimizer").
        switch: the config field of that switch ("offload.offload_optimizer"); None for a
            mode that is always enabled (the plain one).
        words: the mode in words for messages (which optimizer saved a checkpoint).
        precedence: with several modes enabled, the highest one builds the optimizer (the
            others' flags then configure it: ``--zenflow --offload-optimizer`` is ZenFlow
            with its CPU states in the offload engine's tiers).
        requirements: the rules on the other flags while the mode is enabled, checked in
            order when the config is made.
    """

    name: str = ""
    flag: str = ""
    switch: Optional[str] = None
    words: str = ""
    precedence: int = 0
    requirements: Tuple[Requirement, ...] = ()

    def enabled(self, cfg) -> bool:
        """Whether the run (a RunConfig or a saved config dict) has this mode on."""
        return self.switch is None or bool(setting(cfg, self.switch))

    def build(self, cfg, model_chunks, runtime, plan=None):
        """The run's optimizer for this rank's model chunks, through megatron-core's factory.

        ``plan``: the run's memory plan (:mod:`megatron_ext.memory`), made before the model
        was built; a mode may size what it allocates from it (None: no plan).
        """
        raise NotImplementedError

    def log_summary(self, record: dict) -> Optional[str]:
        """The mode's part of the stdout line from its metrics in ``record`` (None: nothing)."""
        return None

    def derived_metrics(self, record: dict) -> Dict[str, float]:
        """Metrics the mode derives from the whole iteration record; none by default.

        The record holds the mode's own metrics and the loop's times; what this returns is
        added to it before it is written.
        """
        return {}

    def checkpoint_problems(self, directory: str) -> List[Tuple[str, str]]:
        """(file, problem) of the files the mode wrote beside dist_checkpointing's."""
        return []

    def measure_tiers(self, cfg, runtime) -> None:
        """Measures what the mode's tiers need measured before the memory plan is made.

        A mode with ``--offload-paths`` probes the paths given without bandwidths here and
        writes the speeds into ``cfg``, so that the plan and the engine place by the same
        numbers. The default: nothing to measure.
        """

    def refit(self, cfg, plan) -> Optional[Tuple[str, Callable[[], None]]]:
        """Re-settles what the mode chose by itself when ``plan`` refuses the run.

        A mode whose ``auto`` setting has another choice that may fit changes ``cfg`` to it
        and returns (the log line saying what it chose and why, a function that undoes the
        change); the start-up plans again and keeps the change only if that plan fits.
        None (the default): nothing to re-settle.
        """
        return None

    def checkpoint_state_bytes(self, cfg, shape) -> float:
        """Bytes per parameter of the optimizer state one checkpoint holds.

        dist_checkpointing writes a replicated shard once, so a checkpoint holds every
        parameter's state once, however the ranks share them. The default is megatron-core's
        optimizer (the plan's :func:`megatron_state_bytes`): fp32 masters beside 16-bit
        weights and the moments (measured: 14.1 B per parameter with --bf16, weights
        included, 12.1 in fp32).
        """
        return float(sum(megatron_state_bytes(cfg, shape)))

    def host_memory_fixes(self, cfg, on_cpu: bool) -> List[str]:
        """What lowers the host memory the mode takes, for a run that ran out of it.

        Flags with a few words on what they move, each a tip of the out-of-memory line
        (``try A, B, or C``); the loop adds those of no mode (data-loader workers, ranks per
        node). ``on_cpu``: a CPU run, whose host memory is also its device's. The default:
        none (the mode keeps nothing on the host).
        """
        return []

    def memory_needs(self, cfg, shape, gpu_room: Optional[int] = None) -> MemoryNeeds:
        """What the mode keeps where, for the memory plan made before the first step.

        Args:
            cfg: the run's config.
            shape: the run's :class:`~megatron_ext.memory.shape.ModelShape`.
            gpu_room: GPU bytes left after the weights, gradients, activations and a
                reserve (None: not known, e.g. a CPU run).

        The default is megatron-core's optimizer: its states on the GPU.
        """
        masters, moments = megatron_state_bytes(cfg, shape)
        fix = ("add --offload-optimizer" if cfg.parallel.use_distributed_optimizer
               else "add --use-distributed-optimizer --offload-optimizer")
        n = shape.shard_elements
        gpu = {"optimizer states": n * (masters + moments)}
        gpu.update(megatron_step_bytes(cfg, shape))
        return MemoryNeeds(gpu=gpu, gpu_fix=fix)


_CPU_OFFLOAD = "optimizer.optimizer_cpu_offload"


class PlainMode(Mode):
    """megatron-core's own optimizer, with megatron-core's ``--optimizer-cpu-offload``."""

    name = "plain"
    flag = ""
    switch = None
    words = "the plain optimizer"
    precedence = 0
    requirements = (
        needs("parallel.use_distributed_optimizer",
              "--optimizer-cpu-offload needs --use-distributed-optimizer", when=_CPU_OFFLOAD),
        only("optimizer.optimizer", "adam",
             "--optimizer-cpu-offload supports --optimizer adam only", when=_CPU_OFFLOAD),
        refuses("training.fp16", "--optimizer-cpu-offload does not support --fp16; use --bf16",
                when=_CPU_OFFLOAD),
        # megatron-core implements the precision-aware optimizer with Transformer Engine's
        # FusedAdam; the offload engine is the one optimizer here that keeps such states.
        needs("offload.offload_optimizer",
              "--use-precision-aware-optimizer is honoured by --offload-optimizer only: "
              "megatron-core implements it with Transformer Engine's FusedAdam, which this "
              "project does not wire; add --offload-optimizer or drop the flag",
              when="optimizer.use_precision_aware_optimizer"),
    )

    def build(self, cfg, model_chunks, runtime, plan=None):
        """megatron-core's optimizer as its factory builds it.

        Raises:
            UsageError: megatron-core's host offload on the CPU (it needs a GPU).
        """
        from megatron_ext.optim.factory import build_megatron_optimizer

        if cfg.optimizer.optimizer_cpu_offload and runtime.is_cpu:
            raise UsageError("--optimizer-cpu-offload is megatron-core's GPU-to-host offload "
                             "and needs a GPU; on the CPU the optimizer states are already in "
                             "host memory")
        return build_megatron_optimizer(cfg, model_chunks)

    def host_memory_fixes(self, cfg, on_cpu: bool) -> List[str]:
        """megatron-core's host offload lowered; on the CPU, the states moved to a disk."""
        fixes = []
        if cfg.optimizer.optimizer_cpu_offload:
            fixes.append("a lower --optimizer-offload-fraction (megatron-core's optimizer "
                         "states on the host)")
        if on_cpu:  # the states live in host memory: the offload engine puts them in files
            flags = ("--offload-optimizer" if cfg.parallel.use_distributed_optimizer
                     else "--use-distributed-optimizer --offload-optimizer")
            fixes.append(f"{flags} --offload-paths DIR (the optimizer states in files on a "
                         "disk)")
        return fixes

    def memory_needs(self, cfg, shape, gpu_room: Optional[int] = None) -> MemoryNeeds:
        """States on the GPU; with --optimizer-cpu-offload, a fraction's moments on the host.

        megatron-core's HybridDeviceOptimizer keeps the offloaded fraction's fp32 params,
        grads and moments in host memory (16 bytes per element) and the fp32 masters of the
        whole shard on the GPU.
        """
        if not cfg.optimizer.optimizer_cpu_offload:
            return super().memory_needs(cfg, shape, gpu_room)
        masters, moments = megatron_state_bytes(cfg, shape)
        n, share = shape.shard_elements, cfg.optimizer.optimizer_offload_fraction
        return MemoryNeeds(
            gpu={"optimizer states": n * masters + int(n * (1 - share)) * moments},
            host={"optimizer states (megatron-core)": int(n * share) * (4 + moments + 4)},
            gpu_fix="add --offload-optimizer (--optimizer-cpu-offload keeps the fp32 masters "
                    "on the GPU)",
            host_fix="lower --optimizer-offload-fraction, or use --offload-optimizer with "
                     "--offload-paths DIR")


_REGISTRY: Dict[str, Mode] = {}
_builtins_loaded = False


def _load_builtins() -> None:
    """Imports the built-in mode modules once (each registers its mode)."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True  # first: the modules' register() calls come back here
    try:
        for module in BUILTIN_MODULES:
            importlib.import_module(module)
    except BaseException:
        _builtins_loaded = False  # the next lookup raises again instead of missing a mode
        raise


def register(mode: Mode) -> Mode:
    """Adds ``mode`` to the registry (after the built-in ones); returns it.

    Raises:
        ValueError: a mode of that name is registered already.
    """
    _load_builtins()
    if mode.name in _REGISTRY:
        raise ValueError(f"an optimizer mode named {mode.name!r} is registered already")
    _REGISTRY[mode.name] = mode
    return mode


def modes() -> List[Mode]:
    """Every registered mode, the plain one first, in the order they were registered."""
    _load_builtins()
    return list(_REGISTRY.values())


def enabled_modes(cfg) -> List[Mode]:
    """The modes ``cfg`` has on (the plain one always), in registry order."""
    return [mode for mode in modes() if mode.enabled(cfg)]


def mode_of(cfg) -> Mode:
    """The mode that builds the run's optimizer: the enabled one of highest precedence.

    ``cfg``: a RunConfig or a saved config dict (a checkpoint's). Of modes of equal
    precedence, the first registered wins.
    """
    found = enabled_modes(cfg)
    return max(found, key=lambda mode: mode.precedence)


def log_summaries(record: dict) -> List[str]:
    """Each registered mode's part of the stdout line that ``record`` has metrics for."""
    return [text for text in (mode.log_summary(record) for mode in modes()) if text]


def derived_metrics(record: dict) -> Dict[str, float]:
    """Every registered mode's metrics derived from ``record`` (see Mode.derived_metrics)."""
    out: Dict[str, float] = {}
    for mode in modes():
        out.update(mode.derived_metrics(record))
    return out


def checkpoint_problems(directory: str) -> List[Tuple[str, str]]:
    """(file, problem) of every mode's own files under the checkpoint at ``directory``."""
    problems: List[Tuple[str, str]] = []
    for mode in modes():
        problems.extend(mode.checkpoint_problems(directory))
    return problems


# Registered directly: register() would load the built-in modes first, ahead of this one.
_REGISTRY[PlainMode.name] = PlainMode()
