"""The one-copy replacement of megatron-core's local grad-norm fallback: same results."""

import pytest
import torch

from megatron_ext.runtime import cpu_compat, grad_norm


@pytest.fixture(autouse=True)
def _cpu():
    cpu_compat.install()  # megatron-core's device="cuda" literals run on the CPU here


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("count", [1, 7, 300])
def test_l2_norm_equals_the_fallback_bitwise(dtype, count):
    from megatron.core.utils import local_multi_tensor_l2_norm

    assert grad_norm.install()
    gen = torch.Generator().manual_seed(count)
    tensors = [(torch.randn(int(torch.randint(1, 5000, (1,), generator=gen)), generator=gen)
                * 10.0 ** float(torch.randint(-6, 6, (1,), generator=gen))).to(dtype)
               for _ in range(count)]
    want, _ = local_multi_tensor_l2_norm(65536, None, [tensors], False)
    got, _ = grad_norm.l2_norm(65536, None, [tensors], False)
    assert got.dtype == want.dtype == torch.float32
    assert torch.equal(got, want)


def test_installed_where_get_grad_norm_fp32_takes_it():
    from megatron.core.optimizer import clip_grads

    assert grad_norm.install()
    assert clip_grads.l2_norm_impl is grad_norm.l2_norm
    assert grad_norm.install()  # idempotent
    grads = [torch.full((4,), 3.0), torch.full((9,), 4.0)]
    # What get_grad_norm_fp32 does before its all-reduce.
    norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, None, [grads], False)
    assert float(norm) == pytest.approx((4 * 9 + 9 * 16) ** 0.5, rel=1e-6)


def test_mixed_dtypes_take_the_original_path():
    from megatron.core.utils import local_multi_tensor_l2_norm

    grad_norm.install()
    tensors = [torch.ones(3), torch.ones(5, dtype=torch.bfloat16)]
    got, _ = grad_norm.l2_norm(65536, None, [tensors], False)
    want, _ = local_multi_tensor_l2_norm(65536, None, [tensors], False)
    assert torch.equal(got, want)
