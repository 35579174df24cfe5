"""The plan at start-up and the engine place the subgroups over the paths alike.

The paths given without bandwidths are probed once, before the plan (issue 39: the plan
printed 3+1 subgroups on two paths where the engine, placing by the speeds it probed after
the plan, put 2+2).
"""

from __future__ import annotations

import types
from collections import Counter

import torch

from megatron_ext.config import parse_config
from megatron_ext.memory.shape import model_shape, state_nbytes
from megatron_ext.memory.startup import plan_before_start
from megatron_ext.offload import optimizer as offload_optimizer
from megatron_ext.offload.plan import TierPlan
from megatron_ext.offload.probe import ProbeResult
from megatron_ext.optim.modes import mode_of

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
         "--global-batch-size", "1", "--lr", "1e-3", "--train-iters", "2", "--mock-data",
         "--vocab-size", "256", "--bf16", "--use-distributed-optimizer",
         "--offload-optimizer", "--offload-subgroup-size", "10000"]
# Probed speeds 3:1 (read = write): the bandwidth rule puts three subgroups on the fast path
# for one on the slow one.
SPEEDS = {"fast": 3.0, "slow": 1.0}


def _fake_probe(calls):
    def probe(path, **kwargs):
        calls.append(path)
        rate = SPEEDS[path.rstrip("/").rsplit("/", 1)[-1]]
        return ProbeResult(read_gbps=rate, write_gbps=rate, direct_io_used=False, size_mb=1,
                           repeats=3)
    return probe


def test_the_plan_and_the_engine_place_by_one_probe(tmp_path, monkeypatch, capsys):
    dirs = [tmp_path / "fast", tmp_path / "slow"]
    for d in dirs:
        d.mkdir()
    calls = []
    monkeypatch.setattr(offload_optimizer, "probe_bandwidth", _fake_probe(calls))
    monkeypatch.setattr(offload_optimizer, "_broadcast", lambda value: value)
    cfg = parse_config([*SMALL, "--offload-host-cache-gb", "0.0003",
                        "--offload-paths", *map(str, dirs)])
    cfg.check_world(1)
    runtime = types.SimpleNamespace(is_cpu=True, world_size=1, device=None, rank=0)
    plan = plan_before_start(cfg, runtime, 251)
    assert calls == [str(d) for d in dirs]  # probed once each, before the plan
    planned = [path.subgroups for path in plan.paths]
    assert planned[0] == 3 * planned[1] > 0, planned
    # The engine's tier plan from the same cfg: the speeds are read back, nothing probed.
    tiers = offload_optimizer.resolve_tiers(cfg.offload, rank=0)
    assert len(calls) == 2 and [t.effective_gbps for t in tiers] == [1.5, 0.5]
    states = mode_of(cfg).memory_needs(cfg, model_shape(cfg, 251, 1)).tiered
    size, n = states.subgroup_size, states.elements
    numels = [size] * (n // size) + ([n % size] if n % size else [])
    sizes = [state_nbytes(states.arrays, numel) for numel in numels]
    engine = TierPlan(cfg.offload, numels, sizes, max(sizes), tiers=tiers, rank=0,
                      device=torch.device("cpu"))
    homes = Counter(home for home in engine.home if home is not None and home >= 0)
    assert [homes[0], homes[1]] == planned
    assert len(engine.resident) == plan.host_subgroups
