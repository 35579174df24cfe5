"""The offload engine against torch's AdamW, bit for bit, in every configuration.

The engine sees a synthetic shard (parameters of odd sizes in two param groups, so that
subgroups cut through parameters and groups); the reference is torch.optim.AdamW on fp32
masters, which is what megatron-core's distributed optimizer runs on the CPU.
"""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch

from megatron_ext.errors import UsageError
from megatron_ext.offload.config import OffloadConfig
from megatron_ext.offload.engine import OffloadEngine
from megatron_ext.offload.paths import TierSpec
from megatron_ext.offload.subgroups import ShardParam

SIZES = [37, 1000, 5, 2048, 300, 129]
GROUPS = [0, 1, 0, 1, 0, 1]
SWITCHES = ("offload_alternate_order", "offload_delayed_grad_conversion",
            "offload_concurrency_control", "offload_rebalance")
HPARAMS = [{"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0},
           {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}]


class Shard:
    """Model weights (training dtype) and a fresh gradient per step."""

    def __init__(self, dtype: torch.dtype, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.weights = [torch.randn(n, generator=gen).to(dtype) for n in SIZES]
        self.grads = [torch.zeros(n, dtype=dtype) for n in SIZES]
        self.gen = gen

    def new_grads(self) -> None:
        for g in self.grads:
            g.copy_(torch.randn(g.numel(), generator=self.gen) * 0.1)

    def params(self):
        return [ShardParam(numel=n, group=GROUPS[i], grad=lambda i=i: self.grads[i],
                           out=self.weights[i], init=lambda i=i: self.weights[i])
                for i, n in enumerate(SIZES)]


def _engine(tmp_path, shard, n_tiers: int, switches: dict, cache_gb=None, **extra):
    tiers = []
    for i in range(n_tiers):
        directory = tmp_path / f"tier{i}"
        directory.mkdir(exist_ok=True)
        tiers.append(TierSpec(str(directory), read_gbps=2.0 - i, write_gbps=1.0))
    cfg = OffloadConfig(offload_optimizer=True, offload_paths=[t.path for t in tiers],
                        offload_subgroup_size=700, offload_host_cache_gb=cache_gb, **switches,
                        **extra)
    return OffloadEngine(cfg, shard.params(), rank=0, device=torch.device("cpu"), tiers=tiers,
                         run_id="test", model_dtype=shard.dtype, grad_dtype=shard.dtype)


def _reference(shard):
    masters = [torch.nn.Parameter(w.float().clone()) for w in shard.weights]
    groups = [{"params": [m for m, g in zip(masters, GROUPS) if g == k], **HPARAMS[k]}
              for k in range(2)]
    for group in groups:
        group["betas"] = tuple(group["betas"])
    return masters, torch.optim.AdamW(groups)


def _step_both(shard, ref_shard, masters, opt, engine, inv_scale, clip):
    shard.new_grads()
    ref_shard.new_grads()
    for master, g in zip(masters, ref_shard.grads):
        grad = g.float()
        if inv_scale is not None:
            grad.mul_(inv_scale)
        if clip is not None:
            grad.mul_(clip)
        master.grad = grad
    opt.step()
    with torch.no_grad():
        for w, master in zip(ref_shard.weights, masters):
            w.copy_(master)
    engine.step(HPARAMS, inv_scale, clip)


COMBOS = list(itertools.product([True, False], repeat=len(SWITCHES)))


@pytest.mark.parametrize("n_tiers", [0, 1, 2], ids=["host-only", "one-path", "two-paths"])
@pytest.mark.parametrize("combo", COMBOS,
                         ids=["".join("1" if on else "0" for on in c) for c in COMBOS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_engine_equals_torch_adamw(tmp_path, n_tiers, combo, dtype):
    switches = dict(zip(SWITCHES, combo))
    shard, ref_shard = Shard(dtype), Shard(dtype)
    masters, opt = _reference(ref_shard)
    # Three subgroups of 700 x 12 bytes fit the cache: the other three live on the paths.
    engine = _engine(tmp_path, shard, n_tiers, switches,
                     cache_gb=3 * 700 * 12 / 1e9 if n_tiers else None)
    try:
        for step in range(5):
            clip = 0.5 if step == 2 else None
            inv_scale = torch.tensor([0.25]) if step == 3 else None
            _step_both(shard, ref_shard, masters, opt, engine, inv_scale, clip)
            for w, ref in zip(shard.weights, ref_shard.weights):
                assert torch.equal(w, ref), f"step {step + 1}: model weights differ"
        engine.wait_io()
        for index, sg in enumerate(engine.subgroups):
            # fp32 masters and moments, as the math sees them (bf16 runs store remainders).
            state = torch.cat(engine.full_states(index))
            for piece in sg.pieces:
                got = state[piece.offset:piece.offset + piece.length]
                want = masters[piece.param].detach()[piece.start:piece.start + piece.length]
                assert torch.equal(got, want), f"subgroup {index}: master differs"
                st = opt.state[masters[piece.param]]
                n = sg.numel
                got_m = state[n + piece.offset:n + piece.offset + piece.length]
                got_v = state[2 * n + piece.offset:2 * n + piece.offset + piece.length]
                assert torch.equal(got_m, st["exp_avg"][piece.start:piece.start + piece.length])
                assert torch.equal(got_v,
                                   st["exp_avg_sq"][piece.start:piece.start + piece.length])
        if n_tiers:
            on_paths = sum(1 for loc in engine.location if loc is not None)
            assert on_paths >= len(engine.subgroups) - 3, "states did not leave the cache"
    finally:
        engine.close()
    for i in range(n_tiers):
        assert not list((tmp_path / f"tier{i}").rglob("sg*")), "tier files left after close"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_machines_host_adam_gives_every_subgroup_size_the_same_bits(tmp_path, dtype):
    """GPU machines' host Adam (``fused_adam``: the one-pass host kernel) keeps its bits
    whatever the subgroups: the same run with other subgroup sizes (or a ZenFlow
    re-selection's new layout) must not change a weight or a state. torch's fused CPU
    AdamW, used there before, rounded an element by where it sat in its subgroup."""
    results = []
    for size in (97, 700, 10_000):
        shard = Shard(dtype)
        cfg = OffloadConfig(offload_optimizer=True, offload_subgroup_size=size)
        engine = OffloadEngine(cfg, shard.params(), rank=0, device=torch.device("cpu"),
                               tiers=[], run_id=f"test{size}", model_dtype=dtype,
                               grad_dtype=dtype)
        engine.fused_adam = True
        try:
            for step in range(4):
                shard.new_grads()
                engine.step(HPARAMS, None, 0.5 if step == 2 else None)
            engine.wait_io()
            states = [torch.cat(engine.full_states(i)) for i in range(len(engine.subgroups))]
            results.append(([w.clone() for w in shard.weights], engine.subgroups, states))
        finally:
            engine.close()

    def by_param(subgroups, states):
        """Each parameter's (master, exp_avg, exp_avg_sq) assembled from the subgroups."""
        out = [[torch.empty(n) for _ in range(3)] for n in SIZES]
        for sg, state in zip(subgroups, states):
            for piece in sg.pieces:
                for k in range(3):
                    lo = k * sg.numel + piece.offset
                    out[piece.param][k][piece.start:piece.start + piece.length] = \
                        state[lo:lo + piece.length]
        return out

    weights0, subgroups0, states0 = results[0]
    expected = by_param(subgroups0, states0)
    for weights, subgroups, states in results[1:]:
        for a, b in zip(weights0, weights):
            assert torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
        for want, got in zip(expected, by_param(subgroups, states)):
            for x, y in zip(want, got):
                assert torch.equal(x.view(torch.int32), y.view(torch.int32))


def test_alternating_order_reuses_the_cache(tmp_path):
    rates = {}
    for alternate in (True, False):
        shard = Shard(torch.bfloat16)
        engine = _engine(tmp_path, shard, 1, {"offload_alternate_order": alternate},
                         cache_gb=4 * 700 * 12 / 1e9)
        try:
            for step in range(4):
                shard.new_grads()
                engine.step(HPARAMS, None, None)
                if step == 0:
                    engine.metrics()  # the first pass starts on what initialization left
            rates[alternate] = engine.metrics()["offload/cache_hit_rate"]
        finally:
            engine.close()
    # 6 subgroups, 4 buffers: alternating passes start on the subgroups the previous pass
    # left resident; a fixed order with LRU eviction finds none of them.
    assert rates[True] >= 0.3, rates
    assert rates[False] == 0.0, rates


def test_placement_follows_bandwidth(tmp_path):
    shard = Shard(torch.bfloat16)
    engine = _engine(tmp_path, shard, 2, {}, cache_gb=3 * 700 * 12 / 1e9)
    try:
        sizes = [sg.numel for sg in engine.subgroups]
        # Tier 0: 2 GB/s read, 1 write -> 0.667 effective; tier 1: 1 and 1 -> 0.5.
        share0 = sum(s for s, h in zip(sizes, engine.home) if h == 0) / sum(sizes)
        assert abs(share0 - 0.667 / (0.667 + 0.5)) <= max(sizes) / sum(sizes)
        assert engine.home[:2] in ([0, 1], [1, 0]), "consecutive subgroups on one path"
    finally:
        engine.close()


def test_fp32_state_leaves_no_tensor_on_a_path_after_close(tmp_path):
    shard = Shard(torch.bfloat16)
    engine = _engine(tmp_path, shard, 1, {}, cache_gb=3 * 700 * 12 / 1e9)
    shard.new_grads()
    engine.step(HPARAMS, None, None)
    rank_dir = engine.rank_dirs[0]
    assert any(name.endswith(".state") for name in os.listdir(rank_dir))
    for name in os.listdir(rank_dir):
        assert os.stat(os.path.join(rank_dir, name)).st_mode & 0o077 == 0
    engine.close()
    assert not os.path.exists(rank_dir)



SMALL = 300  # subgroup size of the tests below: 12 subgroups (11 x 300 + 219)
BF16_BYTES = 10  # state bytes per element of bf16 weights: fp32 masters as remainders


def _small_engine(tmp_path, shard, cache_subgroups: int, **switches):
    tier = TierSpec(str(tmp_path / "tier0"), read_gbps=2.0, write_gbps=1.0)
    (tmp_path / "tier0").mkdir(exist_ok=True)
    cfg = OffloadConfig(offload_optimizer=True, offload_paths=[tier.path],
                        offload_subgroup_size=SMALL,
                        offload_host_cache_gb=cache_subgroups * SMALL * BF16_BYTES / 1e9,
                        **switches)
    return OffloadEngine(cfg, shard.params(), rank=0, device=torch.device("cpu"), tiers=[tier],
                         run_id="test", model_dtype=shard.dtype, grad_dtype=shard.dtype)


def _limit_free_space(monkeypatch, subgroups_that_fit: int) -> None:
    """The path reports room for the spares plus ``subgroups_that_fit`` full subgroups."""
    from megatron_ext.offload import plan as plan_module

    room = (plan_module.SPARES_PER_SIZE + 1 + subgroups_that_fit) * SMALL * BF16_BYTES
    monkeypatch.setattr(plan_module, "check_free_space", lambda path, need: room)


@pytest.mark.parametrize("alternate", [True, False])
def test_subgroups_the_paths_cannot_hold_stay_in_the_cache(tmp_path, monkeypatch, alternate):
    """A path with room for 5 of the 12 subgroups and a cache of 10 buffers: 7 subgroups
    from the middle live in the cache only (no file, never evicted), the other 5 rotate
    through 3 buffers and the path; the updates equal torch's AdamW, and a checkpoint
    restores all of them."""
    _limit_free_space(monkeypatch, 5)
    shard, ref_shard = Shard(torch.bfloat16), Shard(torch.bfloat16)
    masters, opt = _reference(ref_shard)
    switches = {"offload_alternate_order": alternate}
    engine = _small_engine(tmp_path, shard, 10, **switches)
    try:
        assert engine.resident == set(range(2, 9))
        assert engine.home == [0, 0, *[-1] * 7, 0, 0, 0]
        for step in range(4):
            _step_both(shard, ref_shard, masters, opt, engine, None, 0.5 if step == 1 else None)
            for w, ref in zip(shard.weights, ref_shard.weights):
                assert torch.equal(w, ref), f"step {step + 1}: model weights differ"
            assert all(index in engine.cache for index in engine.resident)
        engine.wait_io()
        files = set(os.listdir(engine.rank_dirs[0]))
        assert not any(f"sg{i:05d}.state" in files for i in engine.resident), files
        assert sum(f"sg{i:05d}.state" in files for i in (0, 1, 9, 10, 11)) >= 2, files
        engine.save(str(tmp_path / "ckpt"), {})
    finally:
        engine.close()
    restored = _small_engine(tmp_path, shard, 10, **switches)
    try:
        restored.load(str(tmp_path / "ckpt"), {})
        _step_both(shard, ref_shard, masters, opt, restored, None, None)
        for w, ref in zip(shard.weights, ref_shard.weights):
            assert torch.equal(w, ref), "after the load: model weights differ"
    finally:
        restored.close()


def test_paths_too_small_even_with_the_cache_is_one_clear_error(tmp_path, monkeypatch):
    from megatron_ext.offload.paths import TierFullError

    _limit_free_space(monkeypatch, 2)
    with pytest.raises(TierFullError, match="a larger --offload-host-cache-gb helps too"):
        _small_engine(tmp_path, Shard(torch.bfloat16), 6)


# ---------------------------------------------------------------- the device tier

SG = 700 * 12  # bytes of a full subgroup's fp32 state in these tests
# (device tier, host cache, paths) in full subgroups: 6 subgroups, 5 full ones and one of
# 19 elements.
TIER_LAYOUTS = {
    "device-only": (None, None, 0),
    "device+host": (2, None, 0),
    "device+host+two-paths": (2, 3, 2),
}


def _tier_sizes(layout: str, dtype: torch.dtype):
    """(device tier GB, host cache GB, paths) of a layout, for the weights' dtype."""
    device, cache, n_tiers = TIER_LAYOUTS[layout]
    # bf16 weights store fp32 masters as remainders: 10 bytes per element, not 12.
    sg = 700 * (BF16_BYTES if dtype == torch.bfloat16 else 12)
    return (1.0 if device is None else device * sg / 1e9,
            None if cache is None else cache * sg / 1e9, n_tiers)


def _check_states(engine, masters, opt):
    """The engine's states equal the reference's (fp32 views, any tier)."""
    engine.wait_io()
    for index, sg in enumerate(engine.subgroups):
        views = engine.full_states(index)
        for piece in sg.pieces:
            part = slice(piece.offset, piece.offset + piece.length)
            ref = slice(piece.start, piece.start + piece.length)
            want = [masters[piece.param].detach()[ref]]
            if opt is not None:
                st = opt.state[masters[piece.param]]
                want += [st["exp_avg"][ref], st["exp_avg_sq"][ref]]
            for got, expected in zip(views, want):
                assert torch.equal(got[part].cpu(), expected), f"subgroup {index} differs"


def _three_steps_as_torch(shard, ref_shard, masters, opt, engine):
    """Three steps (clipped after the first) equal torch's AdamW: weights and states."""
    for step in range(3):
        _step_both(shard, ref_shard, masters, opt, engine, None, 0.5 if step else None)
    for w, ref in zip(shard.weights, ref_shard.weights):
        assert torch.equal(w, ref)
    _check_states(engine, masters, opt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_device_tier_is_built_where_it_lives(tmp_path, monkeypatch, dtype):
    """The first step builds the device tier's states on the device from the weights there:
    no host staging buffer (on the GPU machine 80 GB of them took 98 s through one); the
    states are those of a build through the host."""
    from megatron_ext.offload import store as store_module

    device_gb, cache_gb, _ = _tier_sizes("device+host", dtype)
    staged = []
    real = store_module.aligned_empty

    def counting(*args, **kwargs):
        staged.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(store_module, "aligned_empty", counting)
    shard, ref_shard = Shard(dtype), Shard(dtype)
    masters, opt = _reference(ref_shard)
    engine = _engine(tmp_path, shard, 0, {}, cache_gb=cache_gb,
                     offload_device_cache_gb=str(device_gb))
    try:
        before = len(staged)
        engine.initialize_from_model()
        # Host buffers for the host subgroups only; no staging of the device tier's.
        assert len(engine.device_members) == 2
        assert all(args[0] == engine.store.buffer_bytes for args in staged[before:])
        assert len(staged) - before <= len(engine.subgroups) - 2
        _three_steps_as_torch(shard, ref_shard, masters, opt, engine)
    finally:
        engine.close()


@pytest.mark.parametrize("stream", [False, True], ids=["cpu-update", "streamed"])
@pytest.mark.parametrize("layout", sorted(TIER_LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_device_tier_and_streamed_update_equal_torch_adamw(tmp_path, monkeypatch, layout,
                                                           stream, dtype):
    from megatron_ext.offload.config import STREAM_SHARE_ENV
    from megatron_ext.offload.tier_model import TierKind

    if stream:
        monkeypatch.setenv(STREAM_SHARE_ENV, "0.5")
    device_gb, cache_gb, n_tiers = _tier_sizes(layout, dtype)
    shard, ref_shard = Shard(dtype), Shard(dtype)
    masters, opt = _reference(ref_shard)
    engine = _engine(tmp_path, shard, n_tiers, {}, cache_gb=cache_gb,
                     offload_device_cache_gb=str(device_gb))
    try:
        kinds = [engine.tier_of(i).kind for i in range(len(engine.subgroups))]
        assert kinds.count(TierKind.DEVICE) == (6 if layout == "device-only" else 2), kinds
        streamed = 0
        for step in range(5):
            clip = 0.5 if step == 2 else None
            inv_scale = torch.tensor([0.25]) if step == 3 else None
            _step_both(shard, ref_shard, masters, opt, engine, inv_scale, clip)
            for w, ref in zip(shard.weights, ref_shard.weights):
                assert torch.equal(w, ref), f"step {step + 1}: model weights differ"
            streamed += engine.metrics()["offload/streamed_subgroups"]
        _check_states(engine, masters, opt)
        if n_tiers:
            kinds = {engine.tier_of(i).kind for i in range(len(engine.subgroups))}
            assert kinds == {TierKind.DEVICE, TierKind.HOST, TierKind.PATH}, kinds
        # Streaming needs host subgroups: none in the device-only layout.
        assert (streamed > 0) == (stream and layout != "device-only"), streamed
    finally:
        engine.close()


def _lowp_reference(shard, layout):
    """Reference of the precision-aware states: stored in the layout's dtypes, fp32 math."""
    from megatron_ext.optim.adamw import adam_update

    states = [[w.float().to(layout.master), torch.zeros(w.numel(), dtype=layout.exp_avg),
               torch.zeros(w.numel(), dtype=layout.exp_avg_sq)] for w in shard.weights]

    def step(count, inv_scale=None, clip=None):
        for i, (state, g) in enumerate(zip(states, shard.grads)):
            grad = g.float()
            if inv_scale is not None:
                grad.mul_(inv_scale)
            if clip is not None:
                grad.mul_(clip)
            wide = [t.float() for t in state]
            adam_update(wide[0], grad, wide[1], wide[2], count, HPARAMS[GROUPS[i]])
            for t, w in zip(state, wide):
                t.copy_(w)
            shard.weights[i].copy_(state[0])
    return states, step


@pytest.mark.parametrize("names", [("fp32", "bf16", "bf16"), ("fp16", "fp32", "fp32")],
                         ids=["bf16-moments", "fp16-master"])
def test_precision_aware_states_are_stored_in_their_dtypes(tmp_path, monkeypatch, names):
    from megatron_ext.offload.config import STREAM_SHARE_ENV
    from megatron_ext.offload.state_format import read_header
    from megatron_ext.offload.states import StateLayout

    monkeypatch.setenv(STREAM_SHARE_ENV, "0.5")
    layout = StateLayout.from_names(*names)
    shard, ref_shard = Shard(torch.bfloat16), Shard(torch.bfloat16)
    states, ref_step = _lowp_reference(ref_shard, layout)
    tiers = []
    for i in range(2):
        (tmp_path / f"tier{i}").mkdir()
        tiers.append(TierSpec(str(tmp_path / f"tier{i}"), read_gbps=2.0 - i, write_gbps=1.0))
    per = layout.nbytes(700)
    assert per == 700 * (8 if names[0] == "fp32" else 10)
    # The dtypes alone (remainders: test_remainders_store_6_bytes_with_bf16_moments).
    cfg = OffloadConfig(offload_optimizer=True, offload_paths=[t.path for t in tiers],
                        offload_subgroup_size=700, offload_host_cache_gb=3 * per / 1e9,
                        offload_device_cache_gb=str(per / 1e9), store_param_remainders=False)
    engine = OffloadEngine(cfg, shard.params(), rank=0, device=torch.device("cpu"),
                           tiers=tiers, run_id="test", model_dtype=shard.dtype,
                           grad_dtype=shard.dtype, layout=layout)
    try:
        for step in range(4):
            shard.new_grads()
            ref_shard.new_grads()
            clip = 0.5 if step == 1 else None
            engine.step(HPARAMS, None, clip)
            ref_step(step + 1, None, clip)
            for w, ref in zip(shard.weights, ref_shard.weights):
                assert torch.equal(w, ref), f"step {step + 1}: model weights differ"
        assert engine.metrics()["offload/state_bytes_per_element"] == layout.bytes_per_element
        engine.wait_io()
        for index, sg in enumerate(engine.subgroups):
            views = engine._views(engine._acquire_sync(index), index)
            assert [v.dtype for v in views] == list(layout.dtypes)
            for piece in sg.pieces:
                for got, want in zip(views, states[piece.param]):
                    assert torch.equal(got[piece.offset:piece.offset + piece.length],
                                       want[piece.start:piece.start + piece.length])
        files = [f for d in engine.rank_dirs for f in os.listdir(d) if f.endswith(".state")]
        assert files, "no subgroup on the paths"
        for d in engine.rank_dirs:
            for name in os.listdir(d):
                if name.endswith(".state"):
                    index = int(name[2:7])
                    assert read_header(os.path.join(d, name))["payload_bytes"] == \
                        layout.nbytes(engine.subgroups[index].numel)
        engine.save(str(tmp_path / "ckpt"), {})
    finally:
        engine.close()
    other = _engine(tmp_path, Shard(torch.bfloat16), 0, {})
    try:
        with pytest.raises(UsageError, match="saved as"):
            other.load(str(tmp_path / "ckpt"), {})
    finally:
        other.close()


def test_auto_device_tier_sizes_from_the_peak_and_gives_memory_back(tmp_path, monkeypatch,
                                                                   caplog):
    from megatron_ext.offload.config import MEMORY_LIMIT_ENV, MEMORY_PEAK_ENV

    # 60 kB of device memory; a peak besides the states of 25 kB at step 1 (room for 4
    # subgroups of 8.4 kB), 45 kB from step 3 on (room for 1).
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(60e3 / 1e9))
    monkeypatch.setenv(MEMORY_PEAK_ENV, f"1:{25e3 / 1e9},3:{45e3 / 1e9}")
    shard, ref_shard = Shard(torch.bfloat16), Shard(torch.bfloat16)
    masters, opt = _reference(ref_shard)
    # Sized in fp32 subgroups: whole masters (remainders change the bytes, not the sizing).
    engine = _engine(tmp_path, shard, 1, {}, cache_gb=4 * SG / 1e9,
                     offload_device_cache_gb="auto", offload_device_reserve_gb=2e-6,
                     store_param_remainders=False)
    try:
        assert engine.device_members == []
        sizes = []
        with caplog.at_level("INFO", logger="megatron_ext.offload.engine"):
            for step in range(4):
                _step_both(shard, ref_shard, masters, opt, engine, None, None)
                for w, ref in zip(shard.weights, ref_shard.weights):
                    assert torch.equal(w, ref), f"step {step + 1}: model weights differ"
                sizes.append(engine.device_bytes())
        # Budget 60 - 25 - 2 = 33 kB: three full subgroups and the small one; then 13 kB.
        assert sizes[0] == sizes[1] == 3 * SG + 19 * 12, sizes
        assert sizes[2] == sizes[3] <= 13e3 and sizes[2] > 0, sizes
        assert any("device tier (auto)" in r.message for r in caplog.records)
        assert any("gives back" in r.message for r in caplog.records)
        _check_states(engine, masters, opt)
    finally:
        engine.close()


def test_auto_device_tier_on_the_cpu_is_none(tmp_path, monkeypatch):
    # auto is the default; on a CPU run (no device memory to measure) it means no device
    # tier (before auto became the default this was refused).
    from megatron_ext.offload.config import MEMORY_LIMIT_ENV

    monkeypatch.delenv(MEMORY_LIMIT_ENV, raising=False)
    engine = _engine(tmp_path, Shard(torch.bfloat16), 0, {}, offload_device_cache_gb="auto")
    try:
        assert engine.device_members == [] and not engine.tier_plan.device_auto
    finally:
        engine.close()


# ---------------------------------------------------------------- remainders


def _all_tier_engine(tmp_path, shard, layout=None, **extra):
    """Device tier, host cache and two paths (two subgroups each), the streamed update."""
    from megatron_ext.offload.states import StateLayout

    layout = layout or StateLayout()
    sg = layout.nbytes(700)
    tiers = []
    for i in range(2):
        (tmp_path / f"tier{i}").mkdir(parents=True, exist_ok=True)
        tiers.append(TierSpec(str(tmp_path / f"tier{i}"), read_gbps=2.0 - i, write_gbps=1.0))
    cfg = OffloadConfig(offload_optimizer=True, offload_paths=[t.path for t in tiers],
                        offload_subgroup_size=700, offload_host_cache_gb=3 * sg / 1e9,
                        offload_device_cache_gb=str(2 * sg / 1e9), **extra)
    return OffloadEngine(cfg, shard.params(), rank=0, device=torch.device("cpu"), tiers=tiers,
                         run_id="test", model_dtype=shard.dtype, grad_dtype=shard.dtype,
                         layout=layout)


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_remainders_equal_whole_masters_on_every_tier(tmp_path, monkeypatch, caplog, moments):
    """bf16 weights: remainders on (the default) and off give the same weights and states
    bit for bit on the device tier, the host cache, the paths and the streamed update,
    with 10 (6) bytes per element in every tier's buffers and files."""
    from megatron_ext.offload.config import STREAM_SHARE_ENV
    from megatron_ext.offload.state_format import read_header
    from megatron_ext.offload.states import StateLayout
    from megatron_ext.offload.tier_model import TierKind

    monkeypatch.setenv(STREAM_SHARE_ENV, "0.5")
    layout = StateLayout.from_names("fp32", moments, moments)
    shards = [Shard(torch.bfloat16), Shard(torch.bfloat16)]
    with caplog.at_level("INFO", logger="megatron_ext.offload.engine"):
        on = _all_tier_engine(tmp_path / "on", shards[0], layout.with_remainders())
    off = _all_tier_engine(tmp_path / "off", shards[1], layout, store_param_remainders=False)
    bpe = 10 if moments == "fp32" else 6
    assert any(f"{bpe} B/element: fp32 masters as 16-bit remainders beside the bf16 "
               "parameters" in r.message for r in caplog.records)
    try:
        assert on.layout.remainders and not off.layout.remainders
        streamed = 0
        for step in range(5):
            clip = 0.5 if step == 2 else None
            for shard in shards:
                shard.new_grads()
            on.step(HPARAMS, None, clip)
            off.step(HPARAMS, None, clip)
            for a, b in zip(*(s.weights for s in shards)):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), step
            record = on.metrics()
            streamed += record["offload/streamed_subgroups"]
            assert record["offload/state_bytes_per_element"] == bpe
        assert streamed > 0
        kinds = {on.tier_of(i).kind for i in range(len(on.subgroups))}
        assert kinds == {TierKind.DEVICE, TierKind.HOST, TierKind.PATH}, kinds
        on.wait_io()
        off.wait_io()
        for index in range(len(on.subgroups)):
            for a, b in zip(on.full_states(index), off.full_states(index)):
                assert torch.equal(a, b), f"subgroup {index} differs"
        files = [os.path.join(d, f) for d in on.rank_dirs for f in os.listdir(d)
                 if f.endswith(".state")]
        assert files
        for name in files:
            index = int(os.path.basename(name)[2:7])
            # (4-byte alignment pads the odd-sized last subgroup's arrays)
            assert read_header(name)["payload_bytes"] == on.layout.nbytes(
                on.subgroups[index].numel)
        assert on.layout.nbytes(700) == 700 * bpe
    finally:
        on.close()
        off.close()


def test_read_states_gives_whole_fp32_masters(tmp_path):
    """What ZenFlow's moves and a Megatron-LM-format checkpoint read: fp32 masters."""
    shards = [Shard(torch.bfloat16), Shard(torch.bfloat16)]
    engines = [_all_tier_engine(tmp_path / "on", shards[0]),
               _all_tier_engine(tmp_path / "off", shards[1], store_param_remainders=False)]
    try:
        for _ in range(3):
            for shard, engine in zip(shards, engines):
                shard.new_grads()
                engine.step(HPARAMS, None, None)
        for param, n in enumerate(SIZES):
            got = [[torch.empty(n) for _ in range(3)] for _ in engines]
            for engine, outs in zip(engines, got):
                engine.read_states(param, 0, n, outs)
            for a, b in zip(*got):
                assert torch.equal(a, b), f"parameter {param} differs"
            assert not torch.equal(got[0][0], got[0][0].bfloat16().float())  # really fp32
        # Reading left the states alone: the next step still agrees.
        for shard, engine in zip(shards, engines):
            shard.new_grads()
            engine.step(HPARAMS, None, None)
        assert all(torch.equal(a, b) for a, b in zip(*(s.weights for s in shards)))
    finally:
        for engine in engines:
            engine.close()


@pytest.mark.parametrize("saved_with,resumed_with", [(True, False), (False, True), (True, True)],
                         ids=["remainders-to-whole", "whole-to-remainders", "remainders"])
def test_checkpoint_resumes_with_either_setting(tmp_path, saved_with, resumed_with):
    """A checkpoint saved with remainders on (off) resumes with them off (on): the states
    convert on load and the steps after it equal the uninterrupted run's."""
    straight, first = Shard(torch.bfloat16), Shard(torch.bfloat16)
    base = _all_tier_engine(tmp_path / "straight", straight)
    engine = _all_tier_engine(tmp_path / "first", first, store_param_remainders=saved_with)
    try:
        for step in range(5):
            straight.new_grads()
            base.step(HPARAMS, None, None)
            if step < 3:
                first.new_grads()
                engine.step(HPARAMS, None, None)
        engine.save(str(tmp_path / "ckpt"), {})
        manifest = json.loads((tmp_path / "ckpt" / "rank00000" / "manifest.json").read_text())
        assert manifest["param_remainders"] is saved_with
    finally:
        engine.close()
    # The model's weights come from the model's checkpoint: the first run's.
    resumed = _all_tier_engine(tmp_path / "second", first, store_param_remainders=resumed_with)
    try:
        resumed.load(str(tmp_path / "ckpt"), {})
        assert resumed.layout.remainders is resumed_with
        for _ in range(2):
            first.new_grads()
            resumed.step(HPARAMS, None, None)
        for a, b in zip(first.weights, straight.weights):
            assert torch.equal(a, b)
        resumed.wait_io()
        for index in range(len(base.subgroups)):
            for a, b in zip(resumed.full_states(index), base.full_states(index)):
                assert torch.equal(a, b), f"subgroup {index} differs"
    finally:
        resumed.close()
        base.close()


def test_whole_masters_that_the_weights_do_not_round_from_are_refused(tmp_path):
    shard = Shard(torch.bfloat16)
    engine = _all_tier_engine(tmp_path / "first", shard, store_param_remainders=False)
    try:
        for _ in range(2):
            shard.new_grads()
            engine.step(HPARAMS, None, None)
        engine.save(str(tmp_path / "ckpt"), {})
    finally:
        engine.close()
    shard.weights[3][7] += 1.0  # the model's weights are not the masters' rounding any more
    resumed = _all_tier_engine(tmp_path / "second", shard)
    try:
        with pytest.raises(UsageError, match="resume with --no-store-param-remainders"):
            resumed.load(str(tmp_path / "ckpt"), {})
    finally:
        resumed.close()


def test_reset_masters_and_initialize_from_set_the_weights_beside_the_remainders(tmp_path):
    """reset_masters_from_model keeps the moments and takes the weights as masters; a fill
    from fp32 masters (ZenFlow's re-selection) makes the weights their bf16 rounding."""
    shard = Shard(torch.bfloat16)
    engine = _all_tier_engine(tmp_path, shard)
    try:
        for _ in range(2):
            shard.new_grads()
            engine.step(HPARAMS, None, None)
        before = [engine.full_states(i) for i in range(len(engine.subgroups))]
        engine.reset_masters_from_model()
        for index, sg in enumerate(engine.subgroups):
            master, exp_avg, exp_avg_sq = engine.full_states(index)
            assert torch.equal(master, before[index][0].bfloat16().float())
            assert torch.equal(exp_avg, before[index][1])
            assert torch.equal(exp_avg_sq, before[index][2])
        gen = torch.Generator().manual_seed(5)
        masters = [torch.randn(n, generator=gen) for n in SIZES]

        def fill(param, start, length, views):
            views[0].copy_(masters[param][start:start + length])
            views[1].fill_(0.5)
            views[2].fill_(0.25)
        engine.initialize_from(fill, step=2)
        for param, n in enumerate(SIZES):
            outs = [torch.empty(n) for _ in range(3)]
            engine.read_states(param, 0, n, outs)
            assert torch.equal(outs[0], masters[param])
            assert torch.equal(shard.weights[param], masters[param].bfloat16())
            assert (outs[2] == 0.25).all()
    finally:
        engine.close()


# ---------------------------------------------------------------- auto sizes, the I/O floor


@pytest.mark.parametrize("peak_kb, members", [(0, [0, 1, 2, 3, 4, 5]), (45, [1])])
def test_a_budgeted_device_tier_is_refined_at_the_first_step(tmp_path, monkeypatch, peak_kb,
                                                             members):
    """The plan's budget places two subgroups on the device before the first step; the
    first step's measured peak grows the tier (promotion order: the path's subgroups
    first, spread) or shrinks it (a subgroup with no path gets one with room), and the
    states equal torch's AdamW throughout."""
    from megatron_ext.offload.config import MEMORY_LIMIT_ENV, MEMORY_PEAK_ENV

    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(60e3 / 1e9))
    monkeypatch.setenv(MEMORY_PEAK_ENV, f"1:{peak_kb * 1e3 / 1e9}")
    shard, ref_shard = Shard(torch.bfloat16), Shard(torch.bfloat16)
    masters, opt = _reference(ref_shard)
    tier = TierSpec(str(tmp_path / "tier0"), read_gbps=2.0, write_gbps=1.0)
    (tmp_path / "tier0").mkdir()
    cfg = OffloadConfig(offload_optimizer=True, offload_paths=[tier.path],
                        offload_subgroup_size=700, offload_host_cache_gb=3 * SG / 1e9,
                        offload_device_reserve_gb=2e-6,
                        # SG counts whole fp32 masters (12 B/element).
                        store_param_remainders=False)
    engine = OffloadEngine(cfg, shard.params(), rank=0, device=torch.device("cpu"),
                           tiers=[tier], run_id="test", model_dtype=shard.dtype,
                           grad_dtype=shard.dtype, device_budget_bytes=2 * SG)
    try:
        assert engine.device_members == [1, 4]
        assert engine.home[1] == engine.home[4] == -1
        for step in range(3):
            _step_both(shard, ref_shard, masters, opt, engine, None, None)
            for w, ref in zip(shard.weights, ref_shard.weights):
                assert torch.equal(w, ref), f"step {step + 1}: model weights differ"
        # Room: 60 kB - peak - 2 kB reserve: 58 kB holds all, 13 kB one subgroup.
        assert sorted(engine.device_members) == sorted(members), engine.device_members
        for index in range(len(engine.subgroups)):
            if index not in members:
                assert engine.home[index] == 0, (index, engine.home)
        _check_states(engine, masters, opt)
    finally:
        engine.close()


@pytest.mark.parametrize("alternate", [True, False])
def test_the_io_floor_is_the_bytes_that_must_cross_over_the_measured_bandwidth(tmp_path,
                                                                              alternate):
    shard = Shard(torch.bfloat16)
    # Without rebalancing the placement stays as planned (the floor follows any moves).
    engine = _engine(tmp_path, shard, 2, {"offload_rebalance": False,
                                          "offload_alternate_order": alternate,
                                          # SG counts whole fp32 masters (12 B/element).
                                          "store_param_remainders": False},
                     cache_gb=3 * SG / 1e9)
    try:
        records = []
        for _ in range(6):
            shard.new_grads()
            engine.step(HPARAMS, None, None)
            records.append(engine.metrics())
        # 6 subgroups, 3 cache buffers: with the alternating order 3 miss per step (the
        # step starts on the 3 the previous one left), without it all 6; each miss is
        # read once and written once.
        each_way = engine.tier_plan.path_io_per_step()
        small = 19 * 12  # the last subgroup's bytes
        assert sum(each_way) == (3 * SG - (SG - small) / 2 if alternate else 5 * SG + small)
        for before, record in zip(records[1:], records[2:]):
            floors = []
            for i in range(2):
                half = record[f"offload/path{i}_floor_bytes"] / 2
                assert half == each_way[i]
                floors.append(half / (record[f"offload/path{i}_read_gbps"] * 1e9)
                              + half / (record[f"offload/path{i}_write_gbps"] * 1e9))
                # The steady state moves what the floor counts (two steps: both orders).
                moved = record[f"offload/path{i}_bytes"] + before[f"offload/path{i}_bytes"]
                assert moved == 2 * record[f"offload/path{i}_floor_bytes"]
            assert record["offload/io_floor_s"] == pytest.approx(max(floors), rel=1e-9)
            assert record["offload/io_floor_bytes"] == 2 * sum(each_way)
        assert records[-1]["offload/host_cache_subgroups"] == 3
        assert records[-1]["offload/host_only_subgroups"] == 0
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_host_subgroups_built_in_the_streamed_slot_equal_those_built_in_place(tmp_path,
                                                                              dtype):
    """On CUDA the first step builds each host subgroup's state in the streamed update's
    device slot and copies it down once (store.fill's ``device_slot``). The same path on
    the CPU, with a CPU tensor as the slot: every subgroup passes through it, and the
    states and three steps equal torch's AdamW bit for bit."""
    device_gb, cache_gb, _ = _tier_sizes("device+host", dtype)
    shard, ref_shard = Shard(dtype), Shard(dtype)
    masters, opt = _reference(ref_shard)
    engine = _engine(tmp_path, shard, 0, {}, cache_gb=cache_gb,
                     offload_device_cache_gb=str(device_gb))
    slot = torch.zeros(engine.store.buffer_bytes, dtype=torch.uint8)
    built = []
    engine.streamed.fill_slot = lambda: slot
    try:
        store_fill = engine.store.fill

        def fill(sources, order, before=None, device_direct=False, device_slot=None):
            assert device_slot is slot

            def traced(index, buffer):
                if buffer.data_ptr() == slot.data_ptr():
                    built.append(index)
                sources(index, buffer)
            return store_fill(traced, order, before=before, device_direct=device_direct,
                              device_slot=device_slot)
        engine.store.fill = fill
        engine.initialize_from_model()
        hosted = [i for i in range(len(engine.subgroups)) if i not in engine.device_members]
        assert hosted and sorted(built) == sorted(hosted)
        _three_steps_as_torch(shard, ref_shard, masters, opt, engine)
    finally:
        engine.close()
