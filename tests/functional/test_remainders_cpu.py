"""fp32 masters as 16-bit remainders beside the bf16 weights, in whole runs on the CPU.

With --bf16 the offload engine stores each master as its low 16 bits (the default), or
whole with --no-store-param-remainders. The losses are the same bit for bit on every tier
combination (remainders on: tests/functional/test_offload_cpu.py against the plain
optimizer; whole masters here, against the same), with bf16 moments, at DP=2 and TP=2,
and in ZenFlow's tiers; resume is exact with remainders on every tier, and a checkpoint
saved with whole masters resumes with remainders.
"""

from __future__ import annotations

import json

import pytest

from mext_testing import (
    TINY,
    baseline_losses,
    losses_of,
    read_metrics,
    run_pretrain,
    straight_and_resumed,
)

ITERS = 20
# TINY's cosine decay: the command of the other modules' plain runs (the run cache's).
BASE = [*TINY, "--train-iters", str(ITERS), "--use-distributed-optimizer"]
STREAM = "MEGATRON_EXT_OFFLOAD_STREAM_SHARE"
WHOLE = ["--no-store-param-remainders"]
SUBGROUPS = ["--offload-subgroup-size", "10000"]


def tiers(tmp_path, layout: str, bytes_per_element: int) -> list:
    """Device only; device + host; device + host + two paths (a cache of three): about
    four subgroups of 10k elements in the device tier where there is a host tier."""
    if layout == "device-only":
        return ["--offload-optimizer", "--offload-device-cache-gb", "1", *SUBGROUPS]
    device = ["--offload-device-cache-gb", str(4.5 * 10000 * bytes_per_element / 1e9)]
    if layout == "device+host":
        return ["--offload-optimizer", *device, *SUBGROUPS]
    dirs = []
    for i in range(2):
        (tmp_path / f"tier{i}").mkdir(exist_ok=True)
        dirs.append(f"{tmp_path / f'tier{i}'}@{2 if i == 0 else 1},1")
    return ["--offload-optimizer", *device, *SUBGROUPS, "--offload-paths", *dirs,
            "--offload-host-cache-gb", str(3.5 * 10000 * bytes_per_element / 1e9)]


@pytest.fixture(scope="module")
def baseline(run_cache):
    """Losses of the plain distributed optimizer (megatron-core's fp32 masters)."""
    return baseline_losses(run_cache, BASE)


def run(tmp_path, flags, name, nproc=1, env=None):
    out = tmp_path / name
    result = run_pretrain([*BASE, *flags, "--metrics-path", str(out)], nproc=nproc, env=env)
    records = read_metrics(out)
    return result, records, [r for r in records if "offload/cache_hit_rate" in r][-1]


TIER_MATRIX = [("device-only", False), ("device+host", True), ("all-tiers", False),
               ("all-tiers", True)]


@pytest.mark.parametrize("layout,stream", TIER_MATRIX,
                         ids=[f"{lay}{'-streamed' if s else ''}" for lay, s in TIER_MATRIX])
def test_whole_masters_give_the_remainders_losses(tmp_path, baseline, layout, stream):
    """--no-store-param-remainders: 12 bytes per element and the plain optimizer's losses,
    which the default (remainders, 10 bytes) gives too (test_offload_cpu.py's
    test_state_tiers_match_plain_optimizer, the same tier combinations)."""
    _, records, last = run(tmp_path, ["--bf16", *WHOLE, *tiers(tmp_path, layout, 12)],
                           "whole.jsonl", env={STREAM: "0.5"} if stream else None)
    assert losses_of(records) == baseline("bf16")
    assert last["offload/state_bytes_per_element"] == 12
    assert last["offload/device_subgroups_n"] == (12 if layout == "device-only" else 4)
    assert (last["offload/streamed_subgroups"] > 0) == stream


def test_remainders_resume_exactly_from_every_tier(tmp_path, run_cache, baseline, monkeypatch):
    """Device tier, host cache and two paths, the streamed update: a checkpoint at 10
    (its files hold remainders, its manifest says so) resumes on the uninterrupted curve,
    which is the plain optimizer's."""
    monkeypatch.setenv(STREAM, "0.5")
    flags = [*BASE, "--bf16", *tiers(tmp_path, "all-tiers", 10)]
    straight, resumed = straight_and_resumed(tmp_path, flags, stop_at=10, runs=run_cache)
    assert losses_of(straight) == baseline("bf16")
    assert losses_of(resumed) == losses_of(straight)
    manifest = json.loads((tmp_path / "ckpt" / "iter_0000010" / "offload" / "rank00000" /
                           "manifest.json").read_text())
    assert manifest["param_remainders"] is True and manifest["state_dtypes"] == ["fp32"] * 3
    assert {entry["how"] for entry in manifest["subgroups"]} == {"linked", "written"}
    last = [r for r in straight if "offload/cache_hit_rate" in r][-1]
    assert last["offload/device_subgroups_n"] == 4 and last["offload/io_bytes"] > 0


def test_whole_masters_checkpoint_resumes_with_remainders(tmp_path, baseline):
    """A checkpoint saved with --no-store-param-remainders (or by an older version) resumes
    with remainders on: the states convert on load, the curve goes on unchanged."""
    ckpt = tmp_path / "ckpt"
    _, first, _ = run(tmp_path, ["--bf16", *WHOLE, *tiers(tmp_path, "all-tiers", 12),
                                 "--save", str(ckpt), "--exit-interval", "10"], "first.jsonl")
    manifest = json.loads((ckpt / "iter_0000010" / "offload" / "rank00000" /
                           "manifest.json").read_text())
    assert manifest["param_remainders"] is False
    result, second, last = run(tmp_path, ["--bf16", *tiers(tmp_path, "all-tiers", 10),
                                          "--load", str(ckpt)], "second.jsonl")
    assert last["offload/state_bytes_per_element"] == 10
    assert "10 B/element: fp32 masters as 16-bit remainders beside the bf16 parameters" in \
        result.stdout
    assert losses_of(first) + losses_of(second) == baseline("bf16")


@pytest.mark.distributed
@pytest.mark.parametrize("parallel", [[], ["--tensor-model-parallel-size", "2"]],
                         ids=["dp2", "tp2"])
def test_two_ranks_remainders_equal_whole_masters(tmp_path, parallel):
    """DP=2 and TP=2 over every tier with the streamed update: the same losses with the
    masters as remainders and whole (and each equals the plain optimizer:
    tests/distributed/test_offload_parallel_cpu.py)."""
    env = {STREAM: "0.5"}
    got = {}
    for name, flags, bpe in (("remainders", [], 10), ("whole", WHOLE, 12)):
        where = tmp_path / name
        where.mkdir()
        _, records, last = run(where, ["--bf16", *parallel, *flags,
                                       *tiers(where, "all-tiers", bpe)], "m.jsonl", nproc=2,
                               env=env)
        assert last["offload/state_bytes_per_element"] == bpe
        got[name] = losses_of(records)
    assert got["remainders"] == got["whole"]


def test_zenflow_tiers_use_remainders(tmp_path):
    """ZenFlow's CPU side in the offload tiers (with re-selections at 8 and 16): the same
    losses with the masters as remainders (10 bytes per element) and whole (12)."""
    dirs = []
    for i in range(2):
        (tmp_path / f"tier{i}").mkdir()
        dirs.append(f"{tmp_path / f'tier{i}'}@{2 - i},1")
    flags = ["--bf16", "--zenflow", "--zenflow-select-interval", "8", "--offload-optimizer",
             "--offload-paths", *dirs, *SUBGROUPS, "--offload-host-cache-gb", "0.00036"]
    got = {}
    for name, extra, bpe in (("remainders", [], 10), ("whole", WHOLE, 12)):
        _, records, last = run(tmp_path, [*flags, *extra], f"{name}.jsonl")
        assert last["offload/state_bytes_per_element"] == bpe
        assert sum(r.get("offload/path0_write_bytes", 0) for r in records) > 0
        got[name] = losses_of(records)
    assert got["remainders"] == got["whole"]
