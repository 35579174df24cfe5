"""The runtime config: where the run executes, and how its timers wait.

The conventions of every section are in :mod:`megatron_ext.config`.
"""

from __future__ import annotations

import dataclasses

from megatron_ext.runtime.fields import knob, option


def _step_sync(text: str) -> str:
    if text not in ("device", "stream"):
        raise ValueError("give stream (wait for the training stream only, the default) or "
                         "device (for every stream)")
    return text


@dataclasses.dataclass
class RuntimeConfig:
    """Where the run executes."""

    device: str = option("auto", choices=("auto", "cuda", "cpu"))
    """Device to train on: cuda, cpu (megatron-core through the CPU compatibility layer,
    gloo), or auto (cuda when a GPU is visible)."""

    step_sync: str = knob("stream", env="MEGATRON_EXT_STEP_SYNC", parse=_step_sync)
    """What the phase timers wait for on a GPU. ``stream`` (the default): the training stream
    only; copies an optimizer leaves running on its own streams (ZenFlow's delayed gradients
    to the host, the CPU update's weights to the GPU) go on into the next iteration, and
    whatever waits for them later pays for them there. ``device``: every stream of the
    device, so each phase's time includes those copies. The iteration time is wall time
    either way."""
