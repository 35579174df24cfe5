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
])
def test_refused(argv, message):
    with pytest.raises(UsageError, match=message):
        parse_config(argv)


@pytest.mark.parametrize("argv,device_bytes,auto,names", [
    (OFFLOAD, 0, False, ["fp32"] * 3),
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
