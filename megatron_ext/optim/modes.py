"""Optimizer modes: each one's flag, rules, optimizer, log line and checkpoint files in one place.

A mode is how the run's optimizer keeps its states: megatron-core's own optimizer (the
plain mode, with megatron-core's ``--optimizer-cpu-offload``), the offload engine's
(``--offload-optimizer``, :mod:`megatron_ext.offload.mode`) or ZenFlow's (``--zenflow``,
:mod:`megatron_ext.zenflow.mode`). Each is one :class:`Mode` object in the registry here;
the config checks its :attr:`Mode.requirements`, the optimizer seam calls its
:meth:`Mode.build`, the stdout line asks its :meth:`Mode.log_summary`, the checkpoint
integrity check its :meth:`Mode.checkpoint_problems` and the checkpoint load its
:attr:`Mode.words`. None of those name a mode.

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

    def build(self, cfg, model_chunks, runtime):
        """The run's optimizer for this rank's model chunks, through megatron-core's factory."""
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

    def build(self, cfg, model_chunks, runtime):
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
