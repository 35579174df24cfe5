"""The updaters: CPU Adam equals torch's AdamW bit for bit, every gradient source and
updater does the same arithmetic, and the gradient source is chosen at construction."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.offload.masters import read_masters
from megatron_ext.offload.remainders import sign_bits
from megatron_ext.offload.staging import (
    Fp32FirstGrads,
    HostGrads,
    HostWriteBack,
    gather_grads,
    gather_params,
    gradient_source,
    scatter,
)
from megatron_ext.offload.states import StateLayout
from megatron_ext.offload.store import StepStats
from megatron_ext.offload.subgroups import ShardParam, partition
from megatron_ext.offload.updaters import (
    CpuUpdater,
    DeviceUpdater,
    StepArgs,
    SubgroupAdam,
    SyncStreamUpdater,
    stream_updater,
)

from .test_store import make_store

NUMELS = [37, 300, 5, 129]
GROUPS = [0, 1, 0, 1]
SIZE = 100
HPARAMS = [{"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0},
           {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}]
CLIPS = [None, 0.5, None]
SCALES = [None, None, torch.tensor([0.25])]


class Shard:
    """bf16 weights and gradients of four parameters cut into subgroups of SIZE elements."""

    def __init__(self, seed=0, layout=None):
        gen = torch.Generator().manual_seed(seed)
        self.weights = [torch.randn(n, generator=gen).bfloat16() for n in NUMELS]
        self.grads = [torch.zeros(n, dtype=torch.bfloat16) for n in NUMELS]
        self.gen = gen
        self.params = [ShardParam(numel=n, group=GROUPS[i], grad=lambda i=i: self.grads[i],
                                  out=self.weights[i], init=lambda i=i: self.weights[i])
                       for i, n in enumerate(NUMELS)]
        self.subgroups = partition(NUMELS, GROUPS, SIZE)
        self.layout = layout or StateLayout()
        self.states = []
        for sg in self.subgroups:
            buffer = torch.zeros(self.layout.nbytes(sg.numel), dtype=torch.uint8)
            master = self.layout.views(buffer, sg.numel)[0]
            if self.layout.remainders:  # zero remainders beside bf16 weights: exact masters
                self.states.append(buffer)
                continue
            for piece in sg.pieces:
                master[piece.offset:piece.offset + piece.length].copy_(
                    self.weights[piece.param][piece.start:piece.start + piece.length])
            self.states.append(buffer)

    def new_grads(self):
        for g in self.grads:
            g.copy_(torch.randn(g.numel(), generator=self.gen) * 0.1)


def reference(steps=3):
    """torch.optim.AdamW on fp32 masters, with megatron-core's unscale-then-clip."""
    shard = Shard()
    masters = [torch.nn.Parameter(w.float().clone()) for w in shard.weights]
    opt = torch.optim.AdamW([{"params": [m for m, g in zip(masters, GROUPS) if g == k],
                              **HPARAMS[k]} for k in range(2)])
    for step in range(steps):
        shard.new_grads()
        for master, g in zip(masters, shard.grads):
            grad = g.float()
            if SCALES[step] is not None:
                grad.mul_(SCALES[step])
            if CLIPS[step] is not None:
                grad.mul_(CLIPS[step])
            master.grad = grad
        opt.step()
    return masters, opt


def run(shard, updater, steps=3):
    """``steps`` steps of every subgroup through ``updater``, in alternating order."""
    for step in range(steps):
        shard.new_grads()
        order = list(range(len(shard.subgroups)))[::(-1 if step % 2 else 1)]
        args = StepArgs(step + 1, HPARAMS, SCALES[step], CLIPS[step],
                        device_inv_scale=SCALES[step])
        if isinstance(updater, CpuUpdater):
            updater.begin(order, args)
        for index in order:
            updater.update(index, shard.states[index], args)
        if isinstance(updater, CpuUpdater):
            updater.end()


def cpu_updater(shard, grads=None):
    param_dtype = torch.bfloat16 if shard.layout.remainders else None
    grads = grads or HostGrads(shard.params, shard.subgroups, SIZE, param_dtype)
    return CpuUpdater(shard.subgroups, grads, SubgroupAdam(shard.subgroups, shard.layout, False),
                      HostWriteBack(shard.params, shard.subgroups), StepStats(0))


def assert_equal_to_reference(shard, masters, opt):
    for w, master in zip(shard.weights, masters):
        assert torch.equal(w, master.detach().bfloat16()), "model weights differ"
    for index, sg in enumerate(shard.subgroups):
        views = shard.layout.views(shard.states[index], sg.numel)
        for piece in sg.pieces:
            part = slice(piece.offset, piece.offset + piece.length)
            ref = slice(piece.start, piece.start + piece.length)
            st = opt.state[masters[piece.param]]
            for got, want in zip(views, (masters[piece.param].detach(), st["exp_avg"],
                                         st["exp_avg_sq"])):
                assert torch.equal(got[part], want[ref]), f"subgroup {index} differs"


def test_cpu_updater_equals_torch_adamw_bit_for_bit():
    masters, opt = reference()
    shard = Shard()
    updater = cpu_updater(shard)
    run(shard, updater)
    assert_equal_to_reference(shard, masters, opt)
    elements, seconds = updater.take_counts()
    assert elements == 3 * sum(NUMELS) and seconds > 0
    assert updater.take_counts() == (0, 0.0)


@pytest.mark.parametrize("n_paths", [0, 1], ids=["in-memory", "grad-files"])
def test_delayed_and_fp32_first_give_the_same_result(tmp_path, n_paths):
    shard = Shard()
    run(shard, cpu_updater(shard))
    delayed = [t.clone() for t in shard.states], [w.clone() for w in shard.weights]
    shard = Shard()
    store = make_store(tmp_path, n_paths=n_paths, cache_subgroups=3, numels=NUMELS,
                       groups=GROUPS)
    try:
        grads = gradient_source(False, shard.params, shard.subgroups, SIZE,
                                device=torch.device("cpu"), grad_dtype=torch.bfloat16,
                                store=store)
        assert isinstance(grads, Fp32FirstGrads)
        run(shard, cpu_updater(shard, grads))
        assert grads._staged == {}, "the step's gradients outlived it"
        if n_paths:  # nothing in the store's cache: every subgroup's gradients went to a file
            assert sum(store.stats.write_bytes) == sum(store.stats.read_bytes) > 0
    finally:
        store.close()
    for got, want in zip(shard.states + shard.weights, delayed[0] + delayed[1]):
        assert torch.equal(got, want)


def test_gradient_source_is_chosen_at_construction(tmp_path):
    shard = Shard()
    grads = gradient_source(True, shard.params, shard.subgroups, SIZE,
                            device=torch.device("cpu"), grad_dtype=torch.bfloat16, store=None)
    assert type(grads) is HostGrads


def test_device_and_streamed_updaters_equal_the_cpu_one(tmp_path):
    """On a CPU run the device is the CPU: the same arithmetic, bit for bit."""
    masters, opt = reference()
    shard = Shard()
    adam = SubgroupAdam(shard.subgroups, shard.layout, False)
    on_device = DeviceUpdater(shard.params, shard.subgroups, adam, StepStats(0),
                              device=torch.device("cpu"), max_numel=SIZE, allocate=False)
    run(shard, on_device)
    assert_equal_to_reference(shard, masters, opt)
    assert on_device.stats.device_subgroups == 3 * len(shard.subgroups)

    shard = Shard()
    store = make_store(tmp_path, n_paths=0, numels=NUMELS, groups=GROUPS)
    try:
        on_device = DeviceUpdater(shard.params, shard.subgroups,
                                  SubgroupAdam(shard.subgroups, shard.layout, False),
                                  StepStats(0), device=torch.device("cpu"), max_numel=SIZE,
                                  allocate=False)
        streamed = stream_updater(on_device, store, gpu_update=True)
        assert type(streamed) is SyncStreamUpdater
        run(shard, streamed)
        assert store.stats.streamed_subgroups == 3 * len(shard.subgroups)
        assert streamed.take_counts()[0] == 3 * sum(NUMELS)
    finally:
        store.close()
    assert_equal_to_reference(shard, masters, opt)


# ---------------------------------------------------------------- remainders

MOMENTS = ["fp32", "bf16"]


def full_states(shard):
    """Each subgroup's [fp32 master, exp_avg, exp_avg_sq] as the math sees them."""
    states = []
    for index, sg in enumerate(shard.subgroups):
        views = shard.layout.views(shard.states[index], sg.numel)
        weights = gather_params(shard.params, sg, torch.empty(sg.numel, dtype=torch.bfloat16))
        outs = [torch.empty(sg.numel), torch.empty_like(views[1]), torch.empty_like(views[2])]
        read_masters(shard.layout, views, 0, sg.numel, weights, outs)
        states.append(outs)
    return states


def assert_same_run(whole, remainders):
    for a, b in zip(whole.weights, remainders.weights):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "weights differ"
    for a, b in zip(full_states(whole), full_states(remainders)):
        for x, y in zip(a, b):
            assert torch.equal(x, y), "states differ"


def _layouts(moments):
    whole = StateLayout.from_names("fp32", moments, moments)
    return whole, whole.with_remainders()


@pytest.mark.parametrize("moments", MOMENTS)
def test_subgroup_adam_with_remainders_equals_whole_masters(moments):
    """Five steps of SubgroupAdam on the same inputs: the same masters, moments and
    weights, bit for bit, with 2 bytes of master per element instead of 4."""
    whole_layout, rem_layout = _layouts(moments)
    whole, rem = Shard(layout=whole_layout), Shard(layout=rem_layout)
    assert rem_layout.bytes_per_element == whole_layout.bytes_per_element - 2
    adams = [SubgroupAdam(s.subgroups, s.layout, False) for s in (whole, rem)]
    for step in range(5):
        whole.new_grads()
        rem.new_grads()
        for index, sg in enumerate(whole.subgroups):
            grads = torch.empty(sg.numel)
            gather_grads(whole.params, sg, grads)
            out = adams[0](index, whole.states[index], grads, step + 1, HPARAMS)
            assert out.dtype == torch.float32
            scatter(whole.params, sg, out)
            weights = gather_params(rem.params, sg, torch.empty(sg.numel, dtype=torch.bfloat16))
            out = adams[1](index, rem.states[index], grads.clone(), step + 1, HPARAMS, weights)
            assert out.dtype == torch.bfloat16 and out.data_ptr() == weights.data_ptr()
            scatter(rem.params, sg, out)
        assert_same_run(whole, rem)
    # exp_avg_sq carries "up" bits between steps: some elements rounded up, some down.
    signs = torch.cat([sign_bits_of(rem, i) for i in range(len(rem.subgroups))])
    assert 0 < int((signs < 0).sum()) < signs.numel()


def sign_bits_of(shard, index):
    return sign_bits(shard.layout.views(shard.states[index],
                                        shard.subgroups[index].numel)[2]).clone()


@pytest.mark.parametrize("moments", MOMENTS)
def test_cpu_updater_with_remainders_equals_whole_masters(moments):
    whole_layout, rem_layout = _layouts(moments)
    whole, rem = Shard(layout=whole_layout), Shard(layout=rem_layout)
    run(whole, cpu_updater(whole), steps=3)
    run(rem, cpu_updater(rem), steps=3)
    assert_same_run(whole, rem)
    if moments == "fp32":
        masters, opt = reference()
        assert_equal_to_reference(whole, masters, opt)


def test_fp32_first_gradients_with_remainders(tmp_path):
    whole = Shard()
    run(whole, cpu_updater(whole))
    rem = Shard(layout=StateLayout().with_remainders())
    store = make_store(tmp_path, n_paths=1, cache_subgroups=3, numels=NUMELS, groups=GROUPS)
    try:
        grads = gradient_source(False, rem.params, rem.subgroups, SIZE,
                                device=torch.device("cpu"), grad_dtype=torch.bfloat16,
                                store=store, param_dtype=torch.bfloat16)
        run(rem, cpu_updater(rem, grads))
    finally:
        store.close()
    assert_same_run(whole, rem)


@pytest.mark.parametrize("moments", MOMENTS)
def test_device_and_streamed_updaters_with_remainders(tmp_path, moments):
    """The device's and the streamed update's remainders equal the CPU's whole masters."""
    whole_layout, rem_layout = _layouts(moments)
    whole = Shard(layout=whole_layout)
    run(whole, cpu_updater(whole))
    rem = Shard(layout=rem_layout)
    on_device = DeviceUpdater(rem.params, rem.subgroups,
                              SubgroupAdam(rem.subgroups, rem_layout, False), StepStats(0),
                              device=torch.device("cpu"), max_numel=SIZE, allocate=True,
                              param_dtype=torch.bfloat16)
    run(rem, on_device)
    assert_same_run(whole, rem)

    rem = Shard(layout=rem_layout)
    store = make_store(tmp_path, n_paths=0, numels=NUMELS, groups=GROUPS, layout=rem_layout)
    try:
        on_device = DeviceUpdater(rem.params, rem.subgroups,
                                  SubgroupAdam(rem.subgroups, rem_layout, False), StepStats(0),
                                  device=torch.device("cpu"), max_numel=SIZE, allocate=False,
                                  param_dtype=torch.bfloat16)
        streamed = stream_updater(on_device, store, gpu_update=True)
        run(rem, streamed)
        assert store.stats.streamed_subgroups == 3 * len(rem.subgroups)
    finally:
        store.close()
    assert_same_run(whole, rem)
