"""ZenFlow's column selection is the same at DP=1, DP=2 and TP=2, and equals brute force.

Two real processes (torch.distributed, gloo) run the selection path of the optimizer
(``matrices_of`` -> ``column_energy`` -> ``global_importance`` -> ``top_columns``):

* DP=2: each rank owns one contiguous half of every matrix's flattened elements, cut
  mid-row like megatron-core's distributed optimizer, and the DP all-reduce completes
  the column importance;
* TP=2: column-parallel weights (rows split, importance summed over TP), row-parallel
  weights (columns split, importance gathered over TP, ``local_mask`` gives each rank its
  slice of the selection) and a replicated weight, all in one call.

The gradients are integer-valued float32, so every sum is exact and any difference from
brute force (``top_columns`` of the whole matrix's column sums of squares) is a bug.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_ext.optim.sharded_optimizer import Shard
from megatron_ext.zenflow.selection import (
    column_energy,
    global_importance,
    local_mask,
    matrices_of,
    top_columns,
)
from mext_testing import free_port

RATIO = 0.3
# name -> (shape, TP partition dim or None). TP splits the partition dim in two halves.
MATRICES = {
    "a": ((7, 13), None),
    "qkv": ((6, 13), 0),
    "proj": ((7, 10), 1),
    "fc1": ((10, 9), 0),
    "fc2": ((5, 14), 1),
}
WORLD = 2


def full_grads() -> dict:
    """Integer-valued float32 gradients in a small range (many ties of importance)."""
    gen = torch.Generator().manual_seed(1234)
    return {name: torch.randint(-3, 4, shape, generator=gen).float()
            for name, (shape, _) in MATRICES.items()}


def brute_force(grad: torch.Tensor) -> list:
    return top_columns((grad.double() ** 2).sum(0), RATIO).tolist()


def dp_cut(rows: int, cols: int) -> int:
    """The boundary of the two DP halves: the middle, moved off a row boundary."""
    cut = rows * cols // 2
    return cut + 1 if cut % cols == 0 else cut


def param_of(grad: torch.Tensor, partition_dim=None) -> torch.Tensor:
    param = torch.zeros_like(grad)
    param.main_grad = grad
    if partition_dim is not None:
        param.tensor_model_parallel = True
        param.partition_dim = partition_dim
    return param


def select(shards, tp_rank=0, tp_size=1, dp_group=None, tp_group=None, params=None):
    """(every matrix, selected whole-matrix columns per matrix) as the optimizer computes
    them: zeros for the matrices of which the rank owns nothing."""
    every, owned = matrices_of(shards, tp_rank, tp_size, params)
    local = [torch.zeros(m.cols, dtype=torch.float64) for m in every]
    for m in owned:
        local[m.key] = column_energy(shards[m.shard].grad(), m)
    importance = global_importance(local, every, dp_group, tp_group)
    return every, [top_columns(v, RATIO) for v in importance]


def dp_shards(grads: dict, rank: int) -> tuple:
    """(shards, all params): like megatron-core's distributed optimizer, a rank's shard
    list leaves out the parameters it owns nothing of (here: all of the first matrix
    belongs to rank 0, so the two ranks' lists differ in length)."""
    shards, params = [], []
    for i, grad in enumerate(grads.values()):
        rows, cols = grad.shape
        cut = rows * cols if i == 0 else dp_cut(rows, cols)
        start, end = (0, cut) if rank == 0 else (cut, rows * cols)
        params.append(param_of(grad))
        if end > start:
            shards.append(Shard(params[-1], 0, start, end))
    return shards, params


def tp_shards(grads: dict, rank: int) -> list:
    shards = []
    for name, grad in grads.items():
        dim = MATRICES[name][1]
        local = grad if dim is None else grad.chunk(WORLD, dim=dim)[rank].contiguous()
        shards.append(Shard(param_of(local, dim), 0, 0, local.numel()))
    return shards


def worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    try:
        grads = full_grads()
        names = list(grads)
        result = {}

        # DP=2: the DP group is the world, no TP.
        shards, params = dp_shards(grads, rank)
        result["dp_owned"] = len(shards)
        matrices, selected = select(shards, dp_group=dist.group.WORLD, params=params)
        result["dp"] = {names[m.key]: s.tolist() for m, s in zip(matrices, selected)}
        result["dp_modes"] = [m.tp_mode for m in matrices]

        # TP=2: the TP group is the world, no DP.
        shards = tp_shards(grads, rank)
        matrices, selected = select(shards, tp_rank=rank, tp_size=WORLD,
                                    tp_group=dist.group.WORLD)
        result["tp"] = {names[m.key]: s.tolist() for m, s in zip(matrices, selected)}
        result["tp_modes"] = {names[m.key]: m.tp_mode for m in matrices}
        result["tp_masks"] = {names[m.key]: local_mask(s, m).tolist()
                              for m, s in zip(matrices, selected)}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_two_ranks(out_dir, timeout: float = 120.0) -> list:
    context = mp.start_processes(worker, args=(free_port(), str(out_dir)), nprocs=WORLD,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            raise AssertionError(f"the two ranks did not finish in {timeout} s")
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


def test_selection_is_the_same_at_dp1_dp2_tp2_and_equals_brute_force(tmp_path):
    grads = full_grads()
    expected = {name: brute_force(grad) for name, grad in grads.items()}
    # The scenario is not trivial: ties exist, and the selection is neither all nor one.
    for name, grad in grads.items():
        assert 1 < len(expected[name]) < grad.shape[1]
    assert any(len(set((g.double() ** 2).sum(0).tolist())) < g.shape[1] for g in grads.values())

    # DP=1: one process, no group; the whole matrix is the shard.
    shards = [Shard(param_of(g), 0, 0, g.numel()) for g in grads.values()]
    matrices, selected = select(shards)
    assert [m.tp_mode for m in matrices] == ["none"] * len(grads)
    assert dict(zip(grads, (s.tolist() for s in selected))) == expected

    results = run_two_ranks(tmp_path)
    for rank, result in enumerate(results):
        assert result["dp_modes"] == ["none"] * len(grads)
        assert result["dp"] == expected, f"DP=2 rank {rank}"
    assert [r["dp_owned"] for r in results] == [len(grads), len(grads) - 1]
    for rank, result in enumerate(results):

        want_modes = {name: {None: "none", 0: "sum", 1: "gather"}[dim]
                      for name, (_, dim) in MATRICES.items()}
        assert result["tp_modes"] == want_modes
        assert result["tp"] == expected, f"TP=2 rank {rank}"
        for name, (shape, dim) in MATRICES.items():
            full = torch.zeros(shape[1], dtype=torch.bool)
            full[expected[name]] = True
            want = full.chunk(WORLD)[rank] if dim == 1 else full
            assert result["tp_masks"][name] == want.tolist(), f"TP=2 rank {rank} {name}"
