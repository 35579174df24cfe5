"""The flags of the tier hierarchy and the precision-aware states: refused in one line
where they cannot be honoured, never accepted and ignored."""

from __future__ import annotations

import pytest

from megatron_ext.config.cli import parse_config
from megatron_ext.errors import UsageError
from mext_testing import TINY

BASE = [*TINY, "--train-iters", "2", "--lr-decay-style", "cosine",
        "--use-distributed-optimizer"]
OFFLOAD = [*BASE, "--offload-optimizer"]


@pytest.mark.parametrize("argv,message", [
    ([*OFFLOAD, "--exp-avg-dtype", "bf16"], "needs --use-precision-aware-optimizer"),
    ([*OFFLOAD, "--main-params-dtype", "fp16"], "needs --use-precision-aware-optimizer"),
    ([*BASE, "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16"],
     "honoured by --offload-optimizer only"),
    ([*OFFLOAD, "--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "fp8"],
     "fp8 is not supported"),
    ([*OFFLOAD, "--offload-device-cache-gb", "lots"], "give a size in GB"),
    ([*OFFLOAD, "--offload-device-cache-gb", "-1"], "give a size in GB"),
    ([*BASE, "--offload-device-cache-gb", "1"], "needs --offload-optimizer"),
    ([*BASE, "--no-offload-gpu-update"], "needs --offload-optimizer"),
    ([*OFFLOAD, "--offload-device-reserve-gb", "-1"], "must be >= 0"),
    ([*OFFLOAD, "--zenflow", "--offload-device-cache-gb", "1"], "--zenflow keeps its own"),
    ([*BASE, "--no-store-param-remainders"], "needs --offload-optimizer"),
    ([*OFFLOAD, "--offload-host-cache-gb", "lots"], "give a size in GB or auto"),
    ([*OFFLOAD, "--offload-host-cache-gb", "-1"],
     r"--offload-host-cache-gb -1: give a size in GB \(>= 0; 0 for no host cache"),
    ([*OFFLOAD, "--offload-host-reserve-gb", "-1"], "must be >= 0"),
    ([*BASE, "--offload-host-cache-gb", "auto", "--offload-host-reserve-gb", "1"],
     "--offload-host-reserve-gb needs --offload-optimizer"),
])
def test_refused(argv, message):
    with pytest.raises(UsageError, match=message):
        parse_config(argv)


@pytest.mark.parametrize("argv,device_bytes,auto,names", [
    (OFFLOAD, 0, True, ["fp32"] * 3),  # auto is the default (it was 0)
    ([*OFFLOAD, "--offload-device-cache-gb", "0"], 0, False, ["fp32"] * 3),
    ([*OFFLOAD, "--offload-device-cache-gb", "auto"], 0, True, ["fp32"] * 3),
    ([*OFFLOAD, "--offload-device-cache-gb", "2.5", "--use-precision-aware-optimizer",
      "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"], 2_500_000_000, False,
     ["fp32", "bf16", "bf16"]),
])
def test_accepted(argv, device_bytes, auto, names):
    cfg = parse_config(argv)
    assert cfg.offload.device_cache_bytes() == device_bytes
    assert cfg.offload.device_cache_auto is auto
    assert cfg.optimizer.state_layout().names == names


def test_offload_path_that_is_a_file_says_so(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UsageError, match=f"--offload-paths {afile}: is a file, not a directory"):
        parse_config([*OFFLOAD, "--offload-paths", str(afile)])
    with pytest.raises(UsageError, match="no such directory; create it"):
        parse_config([*OFFLOAD, "--offload-paths", str(tmp_path / "missing")])


@pytest.mark.parametrize("extra,stored", [([], True), (["--no-store-param-remainders"], False)])
def test_store_param_remainders_is_on_by_default(extra, stored):
    """megatron-core's field name; where it applies is the engine's call (bf16 weights,
    fp32 masters: tests/unit/offload/test_engine.py)."""
    assert parse_config([*OFFLOAD, "--bf16", *extra]).offload.store_param_remainders is stored
@pytest.mark.parametrize("argv,cache", [
    (OFFLOAD, "auto"),
    ([*OFFLOAD, "--offload-host-cache-gb", "auto"], "auto"),
    ([*OFFLOAD, "--offload-host-cache-gb", "AUTO"], "auto"),
    ([*OFFLOAD, "--offload-host-cache-gb", "2.5"], 2.5),
    ([*OFFLOAD, "--offload-host-cache-gb", "0"], 0.0),  # no host cache (needs paths: the plan)
])
def test_host_cache_is_auto_or_a_size(argv, cache):
    cfg = parse_config(argv)
    assert cfg.offload.offload_host_cache_gb == cache
    assert cfg.offload.host_cache_auto is (cache == "auto")


def test_machine_knobs(monkeypatch, tmp_path):
    """The injected MemAvailable and free space: parsed, one free size per path, and
    allowed on a run without --offload-optimizer (the memory plan of any run reads them)."""
    from megatron_ext.offload.config import MEM_AVAILABLE_ENV, PATH_FREE_ENV

    monkeypatch.setenv(MEM_AVAILABLE_ENV, "12.5")
    monkeypatch.setenv(PATH_FREE_ENV, "60,0.5")
    cfg = parse_config(BASE)
    assert cfg.offload.offload_mem_available_gb == 12.5
    assert cfg.offload.offload_path_free_gb == [60.0, 0.5]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    assert parse_config([*OFFLOAD, "--offload-paths", *paths]).offload.offload_paths == paths
    with pytest.raises(UsageError, match="gives 2 free sizes for 1 --offload-paths"):
        parse_config([*OFFLOAD, "--offload-paths", paths[0]])
    monkeypatch.setenv(PATH_FREE_ENV, "60,lots")
    with pytest.raises(UsageError, match="MEGATRON_EXT_PATH_FREE_GB=60,lots: give one number"):
        parse_config(OFFLOAD)
