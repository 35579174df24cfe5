"""Fixtures of ZenFlow's unit tests: offload engines on temporary tier directories."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def make_offload_engine(tmp_path):
    """``make_engine(params, generation)`` for TieredCpuStates, and the engines it made.

    Two tier directories, small subgroups (they cut through groups and pieces) and a host
    cache of three, so that most states live in files; bf16 model weights (the masters as
    remainders beside the upload buffers, unless ``make.settings["cfg"]`` is replaced by
    one with ``store_param_remainders=False``).
    """
    from megatron_ext.offload.config import OffloadConfig
    from megatron_ext.offload.engine import OffloadEngine
    from megatron_ext.offload.paths import TierSpec

    tiers = []
    for i in range(2):
        (tmp_path / f"tier{i}").mkdir(exist_ok=True)
        tiers.append(TierSpec(str(tmp_path / f"tier{i}"), read_gbps=2.0 - i, write_gbps=1.0))
    cfg = OffloadConfig(offload_optimizer=True, offload_paths=[t.path for t in tiers],
                        offload_subgroup_size=5, offload_host_cache_gb=3 * 5 * 12 / 1e9)
    made = []
    make_cfg = {"cfg": cfg}

    def make(params, generation=0):
        engine = OffloadEngine(make_cfg["cfg"], params, rank=0, device=torch.device("cpu"),
                               tiers=tiers, run_id=f"test.selection{generation}",
                               model_dtype=torch.bfloat16, grad_dtype=torch.float32,
                               params_are_model=False)
        # GPU machines' host Adam (the one-pass kernel) when the test asks for it.
        engine.fused_adam = make_cfg.get("fused", False)
        made.append(engine)
        return engine
    make.made = made
    make.settings = make_cfg
    make.root = tmp_path
    return make
