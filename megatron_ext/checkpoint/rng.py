"""The random-number generators' states in a checkpoint, under Megatron-LM's names.

Format 3.0 keeps them as ``rng_state``, one ShardedObject per (PP, TP) rank whose DP ranks
are replicas (Megatron-LM's layout); format 1 kept one file per rank with shorter names.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state(runtime) -> dict:
    """The random states of this process under Megatron-LM's names (its get_rng_state)."""
    from megatron.core import tensor_parallel

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
    }
    if not runtime.is_cpu:
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
        state["rng_tracker_states"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


# Format 1's names of the same states.
_LEGACY_RNG_KEYS = {"random": "random_rng_state", "numpy": "np_rng_state",
                    "torch": "torch_rng_state", "cuda": "cuda_rng_state",
                    "tracker": "rng_tracker_states"}


def set_rng_state(state: dict, runtime) -> None:
    """Restores what :func:`rng_state` took (format 1's names too)."""
    from megatron.core import tensor_parallel

    state = {_LEGACY_RNG_KEYS.get(k, k): v for k, v in state.items()}
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if not runtime.is_cpu and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def rng_sharded_object(runtime):
    """Megatron-LM's ``rng_state``: one object per (PP, TP) rank, DP ranks its replicas."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", [rng_state(runtime)], (runtime.pp, runtime.tp),
                         (runtime.pp_rank, runtime.tp_rank), replica_id=runtime.dp_rank)
