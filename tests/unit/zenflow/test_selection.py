"""ZenFlow's column selection (pure logic, one process).

Proven here: ``segments`` tiles any flattened range of a matrix exactly once, in order,
with partial rows as one-row blocks and whole rows at full width; ``column_energy``
summed over contiguous DP-style cuts of a matrix equals the whole matrix's column sums of
squares exactly; ``top_columns`` equals a brute-force top-k (ties to the lower index); and
the two plans of ``build_plans`` split every shard element onto exactly one side (the GPU
side holds 1-D shards and the selected columns), with ``Plan.gather``/``Plan.scatter``
moving the values there and back exactly.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_ext.optim.sharded_optimizer import Shard
from megatron_ext.zenflow.selection import (
    build_plans,
    column_energy,
    matrices_of,
    segments,
    top_columns,
)


def int_tensor(shape, gen, low=-5, high=6) -> torch.Tensor:
    """Integer-valued float32 (every sum of squares below is exact)."""
    return torch.randint(low, high, shape, generator=gen).float()


def fake_shard(shape, group, start, end, gen) -> Shard:
    param = int_tensor(shape, gen)
    param.main_grad = int_tensor(shape, gen)
    return Shard(param, group, start, end)


# ---------------------------------------------------------------- segments


def _segment_cases():
    cases = [
        (0, 0, 5), (3, 3, 5),            # empty
        (0, 20, 5), (5, 15, 5),          # exactly whole rows
        (1, 4, 5), (5, 6, 5), (9, 10, 5),  # within one row
        (3, 17, 5), (3, 10, 5), (5, 17, 5), (2, 5, 5), (4, 6, 5),  # mid-row ends
        (0, 7, 1), (3, 4, 1), (2, 2, 1),  # cols = 1
        (0, 3, 7), (6, 8, 7), (13, 50, 7),
    ]
    rng = random.Random(0)
    for _ in range(200):
        cols = rng.randint(1, 12)
        total = cols * rng.randint(1, 9)
        start = rng.randint(0, total)
        cases.append((start, rng.randint(start, total), cols))
    return cases


@pytest.mark.parametrize("start,end,cols", _segment_cases())
def test_segments_tile_the_range_once_in_order(start, end, cols):
    segs = segments(start, end, cols)
    pos = 0
    covered = []
    for seg in segs:
        assert seg.offset == pos
        assert seg.rows >= 1 and 0 <= seg.col_lo < seg.col_hi <= cols
        if seg.width < cols:
            assert seg.rows == 1  # a partial row
        else:
            assert (seg.col_lo, seg.col_hi) == (0, cols)
        # The block's elements are the flattened positions it claims to be.
        first = start + seg.offset
        assert first % cols == seg.col_lo
        for r in range(seg.rows):
            row = first // cols + r
            covered.extend(row * cols + c for c in range(seg.col_lo, seg.col_hi))
        pos += seg.rows * seg.width
    assert pos == end - start
    assert covered == list(range(start, end))
    if start == end:
        assert segs == []


def test_segment_view_reads_the_block():
    flat = torch.arange(40, dtype=torch.float32)  # a shard of a [.., 6] matrix from 3
    for seg in segments(3, 43, 6):
        block = seg.view(flat)
        assert block.shape == (seg.rows, seg.width)
        assert block[0, 0].item() == seg.offset


# ---------------------------------------------------------------- column energy


@pytest.mark.parametrize("shape", [(7, 5), (3, 11), (9, 1), (1, 13), (8, 8)])
def test_column_energy_over_a_dp_split_is_the_whole_column_energy(shape):
    gen = torch.Generator().manual_seed(shape[0] * 100 + shape[1])
    rows, cols = shape
    grad = int_tensor(shape, gen, -20, 21)
    n = rows * cols
    for trial in range(10):
        cuts = sorted(torch.randint(0, n + 1, (2,), generator=gen).tolist())
        if trial == 0 and n >= 3:  # surely mid-row cuts when there are such
            cuts = [n // 3 + (cols > 1 and (n // 3) % cols == 0),
                    2 * n // 3 + (cols > 1 and (2 * n // 3) % cols == 0)]
        bounds = [0, *cuts, n]
        total = torch.zeros(cols, dtype=torch.float64)
        for start, end in zip(bounds, bounds[1:]):
            param = torch.zeros(shape)
            param.main_grad = grad
            shard = Shard(param, 0, start, end)
            matrices = matrices_of([shard])[1]
            if start == end:
                assert matrices == []
                continue
            (matrix,) = matrices
            energy = column_energy(shard.grad(), matrix)
            assert energy.dtype == torch.float64 and energy.shape == (cols,)
            total += energy
        assert torch.equal(total, (grad.double() ** 2).sum(0)), bounds


# ---------------------------------------------------------------- top-k


def brute_top(importance: torch.Tensor, k: int) -> list:
    values = importance.tolist()
    order = sorted(range(len(values)), key=lambda j: (-values[j], j))
    return sorted(order[:k])


def expected_k(n: int, ratio: float) -> int:
    return max(1, min(n, math.floor(ratio * n + 0.5)))


@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.3, 0.5, 1.0])
def test_top_columns_equals_brute_force_with_ties(ratio):
    gen = torch.Generator().manual_seed(int(ratio * 1000))
    for n in [1, 2, 3, 5, 7, 10, 13, 64, 101, 300]:
        for high in (2, 4, 1000):  # few distinct values: many ties
            importance = torch.randint(0, high, (n,), generator=gen).double()
            got = top_columns(importance, ratio)
            k = expected_k(n, ratio)
            assert k >= 1
            assert got.dtype == torch.int64
            assert got.tolist() == brute_top(importance, k), (n, ratio, importance)


@pytest.mark.parametrize("n,ratio,k", [(5, 0.5, 3), (7, 0.5, 4), (10, 0.01, 1), (1, 0.01, 1),
                                       (100, 0.01, 1), (20, 0.1, 2), (3, 1.0, 3), (10, 0.25, 3)])
def test_top_columns_count(n, ratio, k):
    assert top_columns(torch.zeros(n, dtype=torch.float64), ratio).tolist() == list(range(k))


# ---------------------------------------------------------------- plans


def _plan_shards(gen):
    """2-D and 1-D params in two groups, each sharded by a sub-range of its elements."""
    specs = [  # shape, group, start, end
        ((7, 5), 0, 3, 33),     # starts and ends mid-row
        ((3, 11), 1, 0, 33),    # the whole matrix
        ((13,), 0, 2, 9),
        ((4, 6), 1, 8, 10),     # within one row
        ((5, 1), 0, 1, 4),      # one column
        ((9,), 1, 0, 9),
        ((6, 7), 0, 14, 28),    # whole rows only
        ((2, 3), 1, 4, 4),      # an empty shard of a matrix
        ((3,), 0, 1, 1),        # an empty 1-D shard
        ((8, 9), 0, 5, 70),
    ]
    return [fake_shard(shape, group, start, end, gen) for shape, group, start, end in specs]


def _masks(shards, matrices, gen):
    masks = {}
    for i, m in enumerate(matrices):
        if i == 0:
            masks[m.shard] = torch.ones(m.cols, dtype=torch.bool)
        elif i == 1:
            masks[m.shard] = torch.zeros(m.cols, dtype=torch.bool)
        else:
            masks[m.shard] = torch.rand(m.cols, generator=gen) < 0.4
    return masks


@pytest.mark.parametrize("seed", range(5))
def test_plans_split_every_element_once_and_move_values_exactly(seed):
    gen = torch.Generator().manual_seed(seed)
    shards = _plan_shards(gen)
    matrices = matrices_of(shards)[1]
    assert sorted(m.shard for m in matrices) == [0, 1, 3, 4, 6, 9]
    masks = _masks(shards, matrices, gen)
    gpu, cpu = build_plans(shards, matrices, masks, torch.device("cpu"))

    # Element ids: 1000 * shard + position in the parameter (flattened), as float64.
    ids = [torch.arange(s.model_param.numel(), dtype=torch.float64)[s.start:s.end] + 1000 * i
           for i, s in enumerate(shards)]
    groups = sorted({s.group for s in shards})
    side_ids = {}
    for name, plan in (("gpu", gpu), ("cpu", cpu)):
        got = []
        for g in groups:
            size = plan.sizes.get(g, 0)
            pieces = plan.pieces.get(g, [])
            assert [p.offset for p in pieces] == [sum(q.length for q in pieces[:j])
                                                  for j in range(len(pieces))]
            assert sum(p.length for p in pieces) == size
            buf = plan.gather(g, lambda i: ids[i], torch.full((size,), -1.0, dtype=torch.float64))
            assert all(shards[int(v) // 1000].group == g for v in buf.tolist())
            got.extend(buf.tolist())
        assert len(got) == len(set(got))
        side_ids[name] = set(got)
    assert plan_total_ok(gpu, cpu, shards, groups)

    expected_gpu, expected_cpu = set(), set()
    for i, s in enumerate(shards):
        for p in range(s.start, s.end):
            if s.model_param.dim() != 2 or bool(masks[i][p % s.model_param.shape[1]]):
                expected_gpu.add(1000 * i + p)
            else:
                expected_cpu.add(1000 * i + p)
    assert side_ids["gpu"] == expected_gpu
    assert side_ids["cpu"] == expected_cpu

    # gather the weights, scatter twice them into a zeroed copy: 2 * weights exactly on
    # the shard, zero outside it.
    copies = [torch.zeros_like(s.model_param) for s in shards]

    def target(i):
        return copies[i].view(-1)[shards[i].start:shards[i].end]

    for plan in (gpu, cpu):
        for g in groups:
            buf = plan.gather(g, lambda i: shards[i].weights(),
                              torch.empty(plan.sizes.get(g, 0)))
            plan.scatter(g, buf * 2, target)
    for s, copy in zip(shards, copies):
        want = torch.zeros_like(s.model_param).view(-1)
        want[s.start:s.end] = 2 * s.model_param.view(-1)[s.start:s.end]
        assert torch.equal(copy.view(-1), want)


def plan_total_ok(gpu, cpu, shards, groups) -> bool:
    """Per group, the two plans hold as many elements as the group's shards."""
    for g in groups:
        numel = sum(s.numel for s in shards if s.group == g)
        if gpu.sizes.get(g, 0) + cpu.sizes.get(g, 0) != numel:
            return False
    return gpu.total() + cpu.total() == sum(s.numel for s in shards)


def test_scatter_casts_to_the_target_dtype():
    gen = torch.Generator().manual_seed(7)
    shard = fake_shard((5, 6), 0, 4, 27, gen)
    shard.model_param = shard.model_param.bfloat16()  # small integers: exact in bf16
    before = shard.model_param.clone()
    matrices = matrices_of([shard])[1]
    mask = torch.tensor([True, False, True, True, False, False])
    gpu, cpu = build_plans([shard], matrices, {0: mask}, torch.device("cpu"))
    assert gpu.sizes[0] == sum(bool(mask[p % 6]) for p in range(4, 27))
    assert cpu.sizes[0] == 23 - gpu.sizes[0]
    for plan in (gpu, cpu):
        values = plan.gather(0, lambda i: shard.weights(), torch.empty(plan.sizes[0]))
        plan.scatter(0, values + 1, lambda i: shard.weights())
    want = before.view(-1).clone()
    want[4:27] += 1
    assert shard.model_param.dtype == torch.bfloat16
    assert torch.equal(shard.model_param.view(-1), want)


def _buffer_shards(gen, dtype=torch.bfloat16):
    """Shards whose params and grads are views into one param and one grad buffer (as
    megatron-core's DDP lays them out): 1-D params, matrices, and a 1-D param on its own."""
    shapes = [(7,), (4, 6), (3,), (5,), (2, 8), (9,), (1,)]
    total = sum(math.prod(s) for s in shapes)
    params = int_tensor((total,), gen).to(dtype)
    grads = int_tensor((total,), gen).to(dtype)
    shards, pos = [], 0
    for i, shape in enumerate(shapes):
        n = math.prod(shape)
        param = params[pos:pos + n].view(shape)
        param.main_grad = grads[pos:pos + n].view(shape)
        start = 1 if i == 1 else 0  # a DP-style cut in one matrix
        shards.append(Shard(param, i % 2, start, n))
        pos += n
    lone = int_tensor((6,), gen).to(dtype)  # its own storage: copied piece by piece
    lone.main_grad = int_tensor((6,), gen).to(dtype)
    shards.append(Shard(lone, 1, 0, 6))
    return shards, params, grads


def test_whole_pieces_in_a_shared_buffer_move_in_one_batch_exactly():
    """1-D shards that share megatron-core's buffers are gathered and scattered with one
    index_select/index_copy_ per buffer: the same values as one copy per piece, casts
    included, nothing outside the pieces written; a replaced buffer is picked up."""
    gen = torch.Generator().manual_seed(11)
    shards, params, grads = _buffer_shards(gen)
    matrices = matrices_of(shards)[1]
    masks = {m.shard: torch.arange(m.cols) % 2 == 0 for m in matrices}
    gpu, cpu = build_plans(shards, matrices, masks, torch.device("cpu"))
    for group in sorted(gpu.sizes):
        runs, covered = gpu._whole(group, lambda i: shards[i].grad())
        assert len(runs) == 1 and len(covered) >= 2
        assert all(id(p) not in covered for p in gpu.pieces[group] if p.shard == 7)

        def one_by_one(flat_of, out):
            for piece in gpu.pieces[group]:
                dst = out[piece.offset:piece.offset + piece.length]
                if piece.segment is None:
                    dst.copy_(flat_of(piece.shard))
                else:
                    block = piece.segment.view(flat_of(piece.shard))
                    dst.view(piece.segment.rows, -1).copy_(block.index_select(1, piece.index))
            return out

        n = gpu.sizes[group]
        want = one_by_one(lambda i: shards[i].grad(), torch.empty(n, dtype=grads.dtype))
        got = gpu.gather(group, lambda i: shards[i].grad(), torch.empty(n, dtype=grads.dtype))
        assert torch.equal(got, want)
        # fp32 masters from bf16 weights, and back with a cast that rounds (x + 1/3).
        masters = gpu.gather(group, lambda i: shards[i].weights(), torch.empty(n))
        assert torch.equal(masters, one_by_one(lambda i: shards[i].weights(), torch.empty(n)))
        expected = params.clone()
        lone_expected = shards[7].model_param.clone()
        for piece in gpu.pieces[group]:
            new = (masters[piece.offset:piece.offset + piece.length] + 1 / 3)
            s = shards[piece.shard]
            target = (lone_expected.view(-1) if piece.shard == 7 else
                      expected[s.model_param.storage_offset():][:s.model_param.numel()])
            target = target[s.start:s.end]
            if piece.segment is None:
                target.copy_(new)
            else:
                piece.segment.view(target).index_copy_(
                    1, piece.index, new.view(piece.segment.rows, -1).to(target.dtype))
        gpu.scatter(group, masters + 1 / 3, lambda i: shards[i].weights())
        assert torch.equal(params, expected)
        assert torch.equal(shards[7].model_param, lone_expected)
    # A new grad buffer (same layout): the runs follow it, the old one is not read.
    fresh = torch.zeros_like(grads)
    for s in shards[:7]:
        n = s.model_param.numel()
        s.model_param.main_grad = fresh[s.model_param.storage_offset():][:n].view(
            s.model_param.shape)
    for group in sorted(gpu.sizes):
        got = gpu.gather(group, lambda i: shards[i].grad(),
                         torch.full((gpu.sizes[group],), 5.0, dtype=grads.dtype))
        from_lone = [p for p in gpu.pieces[group] if p.shard == 7]
        zero = torch.ones_like(got, dtype=torch.bool)
        for p in from_lone:
            zero[p.offset:p.offset + p.length] = False
        assert torch.equal(got[zero], torch.zeros(int(zero.sum()), dtype=grads.dtype))
