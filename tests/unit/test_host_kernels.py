"""The one-pass C kernels of ZenFlow's host side against torch's ops, bit for bit."""

import os
import subprocess
import sys

import pytest
import torch

from megatron_ext.runtime import host_kernels
from mext_testing import ROOT, test_env

LIB = host_kernels.load()
needs_lib = pytest.mark.skipif(LIB is None, reason="no C compiler: the kernels cannot be built")


def torch_reference(acc, grad, inv, clip, first, divisor):
    """What the torch path computes: fp32 copy, unscale, clip, add (or 0 +), divide."""
    out = torch.zeros_like(acc) if first else acc.clone()
    x = grad.to(torch.float32, copy=True)
    if inv is not None:
        x.mul_(inv)
    if clip is not None:
        x.mul_(clip)
    out.add_(x)
    if divisor is not None:
        out.div_(divisor)
    return out


def special_values(dtype):
    info = torch.finfo(dtype)
    return torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0, info.tiny,
                         info.tiny / 4, info.max, -info.max], dtype=torch.float32).to(dtype)


@needs_lib
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("inv,clip,first,divisor", [
    (None, None, False, None), (0.37, None, True, None), (None, 0.81, False, 3),
    (2.0**-12, 0.3, True, 4), (0.125, 0.77, False, 7)])
@pytest.mark.parametrize("threads", [1, 3])
def test_accumulate_equals_torch_bitwise(dtype, inv, clip, first, divisor, threads):
    gen = torch.Generator().manual_seed(7)
    n = 300_017  # not a multiple of any vector width or slab alignment
    scale = torch.logspace(-30, 30, n, base=2.0)
    grad = (torch.randn(n, generator=gen) * scale).to(dtype)
    grad[:9] = special_values(dtype)
    acc = torch.randn(n, generator=gen) * scale.flip(0)
    expected = torch_reference(acc, grad, inv, clip, first, divisor)
    out = acc.clone()
    host_kernels.accumulate(LIB, out, grad, inv_scale=inv, clip=clip, first=first,
                            divisor=divisor, threads=threads)
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))


@needs_lib
def test_accumulate_refuses_tensors_it_cannot_take():
    acc = torch.zeros(8)
    with pytest.raises(ValueError, match="contiguous CPU tensors of equal size"):
        host_kernels.accumulate(LIB, acc, torch.zeros(7, dtype=torch.bfloat16), inv_scale=None,
                                clip=None, first=True, divisor=None, threads=1)
    with pytest.raises(ValueError):
        host_kernels.accumulate(LIB, acc, torch.zeros(16)[::2], inv_scale=None, clip=None,
                                first=True, divisor=None, threads=1)


def _load_in_subprocess(env_extra, tmp_path):
    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
            "from megatron_ext.runtime import host_kernels\n"
            "print('LOADED' if host_kernels.load() is not None else 'NONE')\n")
    env = test_env({"MEGATRON_EXT_CACHE": str(tmp_path / "cache"), **env_extra})
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=120)


def test_no_compiler_falls_back_with_one_warning(tmp_path):
    result = _load_in_subprocess({"CC": str(tmp_path / "no-such-cc")}, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "NONE"
    assert "uses torch" in result.stderr and "Traceback" not in result.stderr


def test_failed_build_falls_back(tmp_path):
    result = _load_in_subprocess({"CC": "false"}, tmp_path)
    assert result.stdout.strip() == "NONE", result.stderr
    assert "failed" in result.stderr


@needs_lib
def test_build_is_cached_and_written_whole(tmp_path):
    first = _load_in_subprocess({}, tmp_path)
    assert first.stdout.strip() == "LOADED", first.stderr
    built = sorted(os.listdir(tmp_path / "cache" / "kernels"))
    assert len(built) == 1 and built[0].startswith("host_kernels-") and built[0].endswith(".so")
    mtime = os.stat(tmp_path / "cache" / "kernels" / built[0]).st_mtime_ns
    again = _load_in_subprocess({}, tmp_path)
    assert again.stdout.strip() == "LOADED"
    assert sorted(os.listdir(tmp_path / "cache" / "kernels")) == built
    assert os.stat(tmp_path / "cache" / "kernels" / built[0]).st_mtime_ns == mtime
