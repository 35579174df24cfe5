"""Remainders: every finite fp32 master survives encode then decode bit for bit, and the
bf16 weights encode gives are torch's cast. Edge values exhaustively, the rest at random."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.offload.remainders import decode, encode, sign_bits


def _bits(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _round_trip(master: torch.Tensor, v_dtype: torch.dtype = torch.float32):
    """(weights, remainders, exp_avg_sq, decoded) of ``master`` through encode/decode."""
    n = master.numel()
    v = torch.rand(n, generator=torch.Generator().manual_seed(1)).to(v_dtype)
    v_before = v.clone()
    weights = torch.empty(n, dtype=torch.bfloat16)
    rem = torch.empty(n, dtype=torch.int16)
    encode(master, rem, sign_bits(v), weights)
    stored_v = v.clone()
    out = torch.empty(n, dtype=torch.float32)
    decode(weights, rem, sign_bits(v), out)
    assert torch.equal(v.view(torch.int16) if v_dtype != torch.float32 else v.view(torch.int32),
                       v_before.view(torch.int16) if v_dtype != torch.float32
                       else v_before.view(torch.int32)), "decode must restore exp_avg_sq"
    return weights, rem, stored_v, out


def _assert_exact(master: torch.Tensor, v_dtype=torch.float32):
    weights, rem, stored_v, out = _round_trip(master, v_dtype)
    assert torch.equal(out.view(torch.int32), master.view(torch.int32)), "master differs"
    assert torch.equal(weights.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(rem, master.view(torch.int16)[0::2])
    # The sign bit of exp_avg_sq is set exactly where the cast rounded the top half up.
    up = master.view(torch.int16)[1::2] != weights.view(torch.int16)
    assert torch.equal(sign_bits(stored_v) < 0, up)
    return up


@pytest.mark.parametrize("high", [0x0000, 0x0001, 0x3F80, 0x3F81, 0x7F7F, 0x7F7E, 0x8000,
                                  0x8001, 0xBF80, 0xFF7F, 0x0080, 0x007F])
def test_every_low_half_of_some_high_halves(high):
    """All 65536 low halves under one high half: ties (0x8000) both ways, subnormals
    (high 0x0001, 0x007F), the largest finite values (0x7F7F: rounding up gives inf), +-0."""
    low = torch.arange(65536, dtype=torch.int64)
    master = _bits(((high << 16) | low).tolist())
    up = _assert_exact(master)
    if high in (0x3F80, 0x3F81):
        # RNE: above the half way up, below it down; the tie goes to the even top half.
        assert up[0x8001:].all() and not up[:0x8000].any()
        assert bool(up[0x8000]) == bool(high & 1)


def test_special_values():
    values = [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), 3.4028234663852886e38,
              -3.4028234663852886e38, 1e-45, -1e-45, 1.1754942e-38, 1.17549435e-38,
              3.3961776e38]  # rounds to inf in bf16
    master = torch.tensor(values, dtype=torch.float32)
    _assert_exact(master)
    assert torch.isinf(master.to(torch.bfloat16)[-1])


@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_masters_round_trip(v_dtype):
    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e-30, 1e-6, 1.0, 1e6, 1e30])
    master = torch.randn(200_000, generator=gen) * scales[
        torch.randint(0, len(scales), (200_000,), generator=gen)]
    raw = torch.randint(-2**31, 2**31, (50_000,), generator=gen, dtype=torch.int64)
    raw = raw.to(torch.int32).view(torch.float32)
    master = torch.cat([master, raw[torch.isfinite(raw)]])
    _assert_exact(master, v_dtype)


def test_decode_clears_the_bit_for_the_math_and_encode_sets_it_on_top_of_any():
    master = torch.tensor([1.0 + 3 * 2**-9, 1.0], dtype=torch.float32)  # rounds up, exact
    v = torch.tensor([0.5, 0.25])
    weights, rem = torch.empty(2, dtype=torch.bfloat16), torch.empty(2, dtype=torch.int16)
    encode(master, rem, sign_bits(v), weights)
    assert v[0].item() == -0.5 and v[1].item() == 0.25
    out = torch.empty(2)
    decode(weights, rem, sign_bits(v), out)
    assert v.tolist() == [0.5, 0.25] and torch.equal(out, master)
    # A second encode with the bit already clear or set gives the same bits.
    encode(master, rem, sign_bits(v), weights)
    encode(master, rem, sign_bits(v), weights)
    assert v[0].item() == -0.5


def test_zero_moments_keep_their_value():
    """Adam's v starts at +0; +0 with the bit set is -0.0, which decode turns back to +0."""
    master = torch.tensor([1.0 + 3 * 2**-9] * 4)
    v = torch.zeros(4)
    weights, rem = torch.empty(4, dtype=torch.bfloat16), torch.empty(4, dtype=torch.int16)
    encode(master, rem, sign_bits(v), weights)
    assert (sign_bits(v) < 0).all()
    out = torch.empty(4)
    decode(weights, rem, sign_bits(v), out)
    assert torch.equal(v.view(torch.int32), torch.zeros(4, dtype=torch.int32))
