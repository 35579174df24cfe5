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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("count", [2, 3, 5])
@pytest.mark.parametrize("first,divisor", [(True, None), (False, 4), (True, 5)])
def test_accumulate_steps_equals_one_step_at_a_time(dtype, count, first, divisor):
    """Several steps in one pass: the roundings of adding them one after the other."""
    gen = torch.Generator().manual_seed(11 + count)
    n = 70_001  # several L1 blocks and slabs, with a ragged tail
    scale = torch.logspace(-20, 20, n, base=2.0)
    grads = [(torch.randn(n, generator=gen) * scale.roll(k * 977)).to(dtype)
             for k in range(count)]
    grads[0][:9] = special_values(dtype)
    # Each step its own loss scale and clip factor, some left out.
    invs = [None if k % 3 == 1 else 2.0 ** -(k + 3) for k in range(count)]
    clips = [None if k % 2 else 0.3 + 0.1 * k for k in range(count)]
    acc = torch.randn(n, generator=gen) * scale.flip(0)
    expected = acc.clone()
    for k in range(count):
        expected = torch_reference(expected, grads[k], invs[k], clips[k], first and k == 0,
                                   divisor if k == count - 1 else None)
    out = acc.clone()
    host_kernels.accumulate_steps(LIB, out, grads, invs, clips, first=first, divisor=divisor,
                                  threads=3)
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))


@needs_lib
def test_accumulate_steps_refuses_bad_batches():
    acc = torch.zeros(8)
    with pytest.raises(ValueError, match="1 to 64 grads"):
        host_kernels.accumulate_steps(LIB, acc, [], [], [], first=True, divisor=None,
                                      threads=1)
    with pytest.raises(ValueError, match="of one dtype"):
        host_kernels.accumulate_steps(
            LIB, acc, [torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16)], [None, None],
            [None, None], first=True, divisor=None, threads=1)


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


# ------------------------------------------------------------------ AdamW

ADAM_SETTINGS = [  # (lr, beta1, beta2, eps, weight_decay): both lerp branches, with/without wd
    (1e-2, 0.9, 0.999, 1e-8, 0.01), (3e-4, 0.9, 0.95, 1e-8, 0.1),
    (1e-3, 0.3, 0.99, 1e-6, 0.0), (1e-3, 0.0, 0.5, 1e-6, 0.0), (1e-3, 0.6, 0.99, 1e-6, 0.1)]


def adamw_formula(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay):
    """torch's reference AdamW op by op (``_single_tensor_adam``) with an IEEE square root.

    torch's CPU ``sqrt`` is not always correctly rounded; the kernel's is. Everything else
    is torch's own ops in torch's order: this is the kernel's documented arithmetic.
    """
    if weight_decay != 0:
        p.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    denom = (torch.sqrt(v.double()).float() / bias_correction2 ** 0.5).add_(eps)
    p.addcdiv_(m, denom, value=-(lr / bias_correction1))


def random_states(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n), gen


def grads_of(n, gen):
    """Gradients over many magnitudes (10^-6 .. 10^1)."""
    return torch.randn(n, generator=gen) * 10.0 ** torch.randint(-6, 2, (n,), generator=gen)


@needs_lib
@pytest.mark.parametrize("settings", ADAM_SETTINGS)
@pytest.mark.parametrize("n,threads", [(1, 1), (97, 2), (300_017, 1), (300_017, 3)])
def test_adamw_is_its_formula_bitwise(settings, n, threads):
    lr, beta1, beta2, eps, wd = settings
    p, m, v, gen = random_states(n, 11)
    kp, km, kv = p.clone(), m.clone(), v.clone()
    for step in range(1, 5):
        g = grads_of(n, gen)
        adamw_formula(p, g, m, v, step, lr, beta1, beta2, eps, wd)
        host_kernels.adamw(LIB, kp, g, km, kv, step=step, lr=lr, beta1=beta1, beta2=beta2,
                           eps=eps, weight_decay=wd, threads=threads)
        for ours, formula in ((kp, p), (km, m), (kv, v)):
            assert torch.equal(ours.view(torch.int32), formula.view(torch.int32)), step


@needs_lib
def test_adamw_is_torch_adamw_to_rounding():
    from megatron_ext.optim.adamw import adam_update

    hp = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    p, m, v, gen = random_states(200_003, 5)
    kp, km, kv = p.clone(), m.clone(), v.clone()
    for step in range(1, 6):
        g = grads_of(p.numel(), gen)
        adam_update(p, g, m, v, step, hp, fused=False)  # torch's reference
        host_kernels.adamw(LIB, kp, g, km, kv, step=step, lr=1e-3, beta1=0.9, beta2=0.95,
                           eps=1e-8, weight_decay=0.1, threads=2)
    torch.testing.assert_close(kp, p, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(kv, v, rtol=1e-5, atol=0)


def _cut_steps(update, n, cuts, steps=4, seed=3):
    """States after ``steps`` AdamW steps, each step one ``update`` call per piece."""
    p, m, v, gen = random_states(n, seed)
    hp = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    bounds = [0, *cuts, n]
    for step in range(1, steps + 1):
        g = grads_of(n, gen)
        for lo, hi in zip(bounds, bounds[1:]):
            parts = [t[lo:hi].clone() for t in (p, g, m, v)]
            update(parts[0], parts[1], parts[2], parts[3], step, hp)
            for t, part in zip((p, m, v), (parts[0], parts[2], parts[3])):
                t[lo:hi] = part
    return p, m, v


@needs_lib
@pytest.mark.parametrize("cuts", [[97 * k for k in range(1, 300)], [1, 5, 33, 16_001]])
def test_host_adam_bits_do_not_depend_on_the_pieces(cuts):
    """The GPU machines' host Adam: the same states cut into other pieces (offload
    subgroups, a ZenFlow re-selection's new layout) keep every bit."""
    from megatron_ext.optim.adamw import adam_update

    def fast(p, g, m, v, step, hp):
        adam_update(p, g, m, v, step, hp, fused=True)

    whole = _cut_steps(fast, 40_000, [])
    cut = _cut_steps(fast, 40_000, cuts)
    for a, b in zip(whole, cut):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_torch_fused_cpu_adam_bits_depend_on_the_pieces():
    """Why the host kernel exists: torch's fused CPU AdamW, which GPU machines used for the
    host side before, gives other bits to the same states cut into other pieces (its
    vector loop and scalar tail round differently), so a re-selection or another subgroup
    size changed the states. If this ever stops holding, torch's kernel could serve."""
    from torch.optim.adam import adam

    def torch_fused(p, g, m, v, step, hp):
        adam([p], [g], [m], [v], [], [torch.tensor(float(step - 1))], foreach=False,
             fused=True, capturable=False, differentiable=False, has_complex=False,
             amsgrad=False, beta1=hp["betas"][0], beta2=hp["betas"][1], lr=hp["lr"],
             weight_decay=hp["weight_decay"], eps=hp["eps"], maximize=False,
             decoupled_weight_decay=True)

    cuts = [97 * k for k in range(1, 300)]
    whole = _cut_steps(torch_fused, 40_000, [])
    cut = _cut_steps(torch_fused, 40_000, cuts)
    assert any(not torch.equal(a, b) for a, b in zip(whole, cut))
