"""The CPU side's states in host memory and in the offload tiers, through one interface.

Proven here: after the same masters and updates both implementations hold the same
states and write the same new weights, bit for bit; a re-selection's refill (``replace``
with a ``fill`` that reads the old states) keeps every value and the step count, in both;
checkpoints round-trip, and each refuses the other's saved form.
"""

from __future__ import annotations

import pytest
import torch
from torch.optim.adam import adam

from megatron_ext.errors import UsageError
from megatron_ext.zenflow.cpu_states import (
    KINDS,
    HostCpuStates,
    TieredCpuStates,
    offload_engines,
)

SIZES = {0: 23, 1: 9}
HPARAMS = [{"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
           {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0}]
LAYOUT = {"dp": 1}


def uploads(sizes):
    return {g: torch.zeros(n, dtype=torch.bfloat16) for g, n in sizes.items()}


def masters(sizes):
    gen = torch.Generator().manual_seed(5)
    return {g: torch.randn(n, generator=gen).to(torch.bfloat16) for g, n in sizes.items()}


def grads(sizes, step):
    gen = torch.Generator().manual_seed(100 + step)
    return {g: torch.randn(n, generator=gen) for g, n in sizes.items()}


def read_all(states, sizes):
    """group -> [master, exp_avg, exp_avg_sq] through ``read``."""
    out = {}
    for group, n in sizes.items():
        out[group] = [torch.full((n,), float("nan")) for _ in KINDS]
        states.read(group, 0, n, out[group])
    return out


def trained(states, sizes, steps):
    """``states`` sized, their masters set and ``steps`` updates taken; the upload buffers."""
    upload = uploads(sizes)
    states.resize(sizes, upload)
    states.set_masters(masters(sizes))
    for step in range(1, steps + 1):
        states.update(grads(sizes, step), HPARAMS)
    return upload


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for group in a:
        for kind, x, y in zip(KINDS, a[group], b[group]):
            assert torch.equal(x, y), (group, kind)


def test_host_states_are_adam_from_the_masters():
    """The host implementation against torch's functional Adam (reference, not fused)."""
    states = HostCpuStates(fused=False)
    upload = trained(states, SIZES, 3)
    for group, n in SIZES.items():
        master = masters(SIZES)[group].float()
        m, v = torch.zeros(n), torch.zeros(n)
        hp = HPARAMS[group]
        for step in range(1, 4):
            adam([master], [grads(SIZES, step)[group]], [m], [v], [],
                 [torch.tensor(float(step - 1))], foreach=False, fused=None, capturable=False,
                 differentiable=False, has_complex=False, amsgrad=False, beta1=hp["betas"][0],
                 beta2=hp["betas"][1], lr=hp["lr"], weight_decay=hp["weight_decay"],
                 eps=hp["eps"], maximize=False, decoupled_weight_decay=True)
        assert_same(read_all(states, {group: n}), {group: [master, m, v]})
        assert torch.equal(upload[group], master.to(torch.bfloat16))
    assert states.steps == 3


def _remainders(make_offload_engine, on: bool) -> None:
    """The fixture's engines with the masters as remainders (the default) or whole."""
    import dataclasses

    settings = make_offload_engine.settings
    settings["cfg"] = dataclasses.replace(settings["cfg"], store_param_remainders=on)


# The host Adam of CPU-only runs (torch's reference) and of GPU machines (the one-pass host
# kernel, ``fused``): each must give the same bits however the states are cut.
FUSED = pytest.mark.parametrize("fused", [False, True], ids=["reference", "gpu-machine"])


@FUSED
@pytest.mark.parametrize("remainders", [True, False], ids=["remainders", "whole-masters"])
def test_host_and_tiers_hold_the_same_states_after_the_same_updates(make_offload_engine,
                                                                    remainders, fused):
    _remainders(make_offload_engine, remainders)
    make_offload_engine.settings["fused"] = fused
    host, tiers = HostCpuStates(fused=fused), TieredCpuStates(make_offload_engine)
    try:
        up_host, up_tiers = trained(host, SIZES, 4), trained(tiers, SIZES, 4)
        assert tiers.engine.layout.remainders is remainders
        assert tiers.engine.layout.bytes_per_element == (10 if remainders else 12)
        assert host.steps == tiers.steps == 4
        got = read_all(tiers, SIZES)
        assert_same(read_all(host, SIZES), got)
        for group in SIZES:
            assert torch.equal(up_host[group], up_tiers[group])
            assert not torch.equal(got[group][0].to(torch.bfloat16), masters(SIZES)[group])
            assert torch.count_nonzero(got[group][2]) > 0  # the moments moved
        # write_upload casts the masters into the buffers, in both. (With remainders the
        # tiers' buffers are the masters' other half: they already hold them, and only the
        # states write them.)
        for states, upload in ((host, up_host), (tiers, up_tiers)):
            if not (states is tiers and remainders):
                for buffer in upload.values():
                    buffer.zero_()
            states.write_upload()
            for group in SIZES:
                assert torch.equal(upload[group], got[group][0].to(torch.bfloat16))
        # Most subgroups in files (a cache of three).
        assert len(tiers.engine.subgroups) > 3
        assert tiers.host_bytes() < host.host_bytes()
    finally:
        host.close()
        tiers.close()


# The new layout: group 0 takes old group 1's last four elements, then old group 0's first
# 15 in reverse; group 1 old group 0's last 8, then old group 1's first 5.
NEW_SIZES = {0: 19, 1: 13}
SOURCES = {0: [(1, i) for i in range(5, 9)] + [(0, i) for i in reversed(range(15))],
           1: [(0, i) for i in range(15, 23)] + [(1, i) for i in range(5)]}


def refill(states, written: dict):
    """A re-selection's fill: the new layout's states read from the old ones (SOURCES)."""
    def fill(group, start, length, views):
        old = read_all(states, SIZES)  # during replace: the replaced states
        for i in range(start, start + length):
            src_group, src = SOURCES[group][i]
            for view, state in zip(views, old[src_group]):
                view[i - start] = state[src]
            written[group][i] += 1
    return fill


@pytest.mark.parametrize("place", ["host", "tiers"])
def test_replace_keeps_every_value(place, make_offload_engine):
    states = HostCpuStates() if place == "host" else TieredCpuStates(make_offload_engine)
    try:
        trained(states, SIZES, 2)
        old = read_all(states, SIZES)
        written = {g: torch.zeros(n, dtype=torch.int64) for g, n in NEW_SIZES.items()}
        upload = uploads(NEW_SIZES)
        states.replace(NEW_SIZES, upload, refill(states, written))
        for group in NEW_SIZES:
            assert torch.equal(written[group], torch.ones_like(written[group]))  # once each
        new = read_all(states, NEW_SIZES)
        for group, sources in SOURCES.items():
            expected = [torch.stack([old[g][k][i] for g, i in sources]) for k in range(3)]
            assert_same({group: new[group]}, {group: expected})
        assert states.steps == 2  # the step count carries over
        states.update(grads(NEW_SIZES, 3), HPARAMS)  # into the new upload buffers
        assert states.steps == 3
        master = read_all(states, NEW_SIZES)
        for group in NEW_SIZES:
            assert torch.equal(upload[group], master[group][0].to(torch.bfloat16))
        if place == "tiers":  # a new engine in its own directory; the old one's files gone
            dirs = {f.parent.parent.name for f in make_offload_engine.root.rglob("sg*")}
            assert dirs == {"test.selection1"} and len(make_offload_engine.made) == 2
    finally:
        states.close()


def test_replace_into_the_replaced_engines_weight_memory_keeps_every_value(
        make_offload_engine):
    """The new upload buffers are views of the old ones' memory (a GPU machine's page-locked
    buffers, reused): group 0 shrinks into its old buffer, group 1 grows out of its own.
    The old engine's masters keep their bf16 half there; the fill of every new subgroup
    reads all the old states (after earlier subgroups wrote their weights over them), and
    still gets each value."""
    states = TieredCpuStates(make_offload_engine)
    try:
        old_upload = trained(states, SIZES, 2)
        old = read_all(states, SIZES)
        upload = {0: old_upload[0][:NEW_SIZES[0]],
                  1: torch.zeros(NEW_SIZES[1], dtype=torch.bfloat16)}
        written = {g: torch.zeros(n, dtype=torch.int64) for g, n in NEW_SIZES.items()}
        states.replace(NEW_SIZES, upload, refill(states, written))
        new = read_all(states, NEW_SIZES)
        for group, sources in SOURCES.items():
            expected = [torch.stack([old[g][k][i] for g, i in sources]) for k in range(3)]
            assert_same({group: new[group]}, {group: expected})
            assert torch.equal(upload[group], new[group][0].to(torch.bfloat16))
        assert states._kept is None  # the kept weights go with the replaced engine
    finally:
        states.close()


@FUSED
def test_host_and_tiers_agree_after_a_replace(make_offload_engine, fused):
    make_offload_engine.settings["fused"] = fused
    results = []
    for states in (HostCpuStates(fused=fused), TieredCpuStates(make_offload_engine)):
        try:
            trained(states, SIZES, 2)
            written = {g: torch.zeros(n, dtype=torch.int64) for g, n in NEW_SIZES.items()}
            upload = uploads(NEW_SIZES)
            states.replace(NEW_SIZES, upload, refill(states, written))
            for step in (3, 4):
                states.update(grads(NEW_SIZES, step), HPARAMS)
            results.append((read_all(states, NEW_SIZES), upload))
        finally:
            states.close()
    (host, up_host), (tiers, up_tiers) = results
    assert_same(host, tiers)
    for group in NEW_SIZES:
        assert torch.equal(up_host[group], up_tiers[group])


def test_host_checkpoint_round_trip():
    saved_states = HostCpuStates()
    trained(saved_states, SIZES, 2)
    saved = saved_states.state_dict()
    assert sorted(saved) == sorted(KINDS)
    states = HostCpuStates()
    states.resize(SIZES, uploads(SIZES))
    states.steps = saved_states.steps
    states.load_state_dict(saved)
    states.load("unused", LAYOUT)  # nothing outside the rank file
    assert_same(read_all(states, SIZES), read_all(saved_states, SIZES))


@pytest.mark.parametrize("saved_with,resumed_with", [(True, True), (False, False),
                                                     (True, False), (False, True)])
def test_tiers_checkpoint_round_trip(make_offload_engine, tmp_path, saved_with, resumed_with):
    """Files hold the states; the rank file only the weights beside remainders. Either
    setting resumes the other's checkpoint (the engine converts on load)."""
    _remainders(make_offload_engine, saved_with)
    saved_states = TieredCpuStates(make_offload_engine)
    try:
        trained(saved_states, SIZES, 2)
        expected = read_all(saved_states, SIZES)
        saved = saved_states.state_dict()
        assert not any(kind in saved for kind in KINDS)  # nothing of the states: files
        assert ("params" in saved) is saved_with
        saved_states.save(str(tmp_path / "ckpt"), LAYOUT)
    finally:
        saved_states.close()
    _remainders(make_offload_engine, resumed_with)
    states = TieredCpuStates(make_offload_engine)
    try:
        upload = uploads(SIZES)
        states.resize(SIZES, upload)
        states.load_state_dict(saved)
        states.load(str(tmp_path / "ckpt"), LAYOUT)
        assert_same(read_all(states, SIZES), expected)
        if resumed_with:  # the buffers beside the remainders hold the masters' weights
            for group in SIZES:
                assert torch.equal(upload[group], expected[group][0].to(torch.bfloat16))
    finally:
        states.close()


def test_each_refuses_the_other_places_checkpoint(make_offload_engine):
    host = HostCpuStates()
    host.resize(SIZES, uploads(SIZES))
    with pytest.raises(UsageError, match="saved with --zenflow-cpu-states tiers"):
        host.load_state_dict({})
    tiers = TieredCpuStates(make_offload_engine)
    try:
        tiers.resize(SIZES, uploads(SIZES))
        with pytest.raises(UsageError, match="saved with --zenflow-cpu-states host"):
            tiers.load_state_dict(host.state_dict())
    finally:
        tiers.close()


def test_offload_engines_name_each_selection_apart(tmp_path):
    """The factory of the optimizer: generation 0 under the run id, then .selectionN."""
    from megatron_ext.offload.config import OffloadConfig
    from megatron_ext.offload.paths import TierSpec
    from megatron_ext.offload.subgroups import ShardParam

    tiers = [TierSpec(str(tmp_path), read_gbps=1.0, write_gbps=1.0)]
    cfg = OffloadConfig(offload_optimizer=True, offload_paths=[str(tmp_path)])
    make = offload_engines(cfg, "run", tiers, rank=0, model_dtype=torch.bfloat16,
                           fused_adam=True)
    out = torch.zeros(4, dtype=torch.bfloat16)
    params = [ShardParam(numel=4, group=0, grad=lambda: torch.zeros(4), out=out,
                         init=lambda: out)]
    engines = [make(params), make(params, 2)]
    try:
        assert [e.fused_adam for e in engines] == [True, True]
        names = {d.name for d in tmp_path.rglob("*") if d.is_dir()}
        assert {"run", "run.selection2"} <= names
    finally:
        for engine in engines:
            engine.close()
