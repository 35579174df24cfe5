"""The CPU worker: a window's update, its two accumulators, its threads' errors, its knobs.

Proven here: a window's update is Adam on the window's mean gradient (unscaled and
clipped per step, in fp32) bit for bit, with either accumulation kernel; windows
alternate between two accumulators, the next one filling while the previous one's update
runs; an exception on either thread reaches the caller that waits; the config's knobs
reach the worker.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.optim.adam import adam

from megatron_ext.errors import UsageError
from megatron_ext.runtime import host_kernels
from megatron_ext.zenflow.config import ZenFlowConfig
from megatron_ext.zenflow.cpu_states import HostCpuStates
from megatron_ext.zenflow.cpu_worker import CpuWorker

HPARAMS = [{"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
           {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0}]


def reference_adam(master, grad, exp_avg, exp_avg_sq, step, hp) -> None:
    """torch's functional AdamW (the reference implementation), in place."""
    beta1, beta2 = hp["betas"]
    adam([master], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step - 1))],
         foreach=False, fused=None, capturable=False, differentiable=False, has_complex=False,
         amsgrad=False, beta1=beta1, beta2=beta2, lr=hp["lr"], weight_decay=hp["weight_decay"],
         eps=hp["eps"], maximize=False, decoupled_weight_decay=True)


@pytest.mark.parametrize("kernels", ["c", "torch"])
def test_a_window_update_is_adam_on_the_mean_gradient(kernels):
    """Three windows of three bf16 steps (a loss scale on some, a clip on one), batched
    two at a time: masters, moments and the new weights equal the reference bit for bit."""
    if kernels == "c" and host_kernels.load() is None:
        pytest.skip("no C compiler: the host kernels cannot be built")
    sizes = {0: 1000, 1: 37}
    gen = torch.Generator().manual_seed(3)
    start = {g: torch.randn(n, generator=gen).to(torch.bfloat16) for g, n in sizes.items()}
    cpu = CpuWorker(sizes, torch.bfloat16, pin=False,
                    knobs=ZenFlowConfig(zenflow_no_host_kernels=kernels == "torch"))
    master = {g: t.float() for g, t in start.items()}
    exp_avg = {g: torch.zeros(n) for g, n in sizes.items()}
    exp_avg_sq = {g: torch.zeros(n) for g, n in sizes.items()}
    try:
        assert (cpu._kernels is None) == (kernels == "torch")
        cpu.batch_steps = 2
        cpu.set_masters(start)
        for window in range(3):
            buffer = window % 2
            steps = []
            for i in range(3):
                grads = {g: (torch.randn(n, generator=gen) * 1e2).to(torch.bfloat16)
                         for g, n in sizes.items()}
                inv = torch.tensor(1 / 512.0 * (1 + i)) if i != 1 else None
                clip = 0.37 if i == 2 else None
                steps.append((grads, inv, clip))
                cpu.accumulate(buffer, grads, inv, clip, last=i == 2)
            cpu.submit_update(buffer, window, HPARAMS)
            cpu.wait_update()
            for group in sizes:
                mean = torch.zeros(sizes[group])
                for grads, inv, clip in steps:
                    x = grads[group].float()
                    if inv is not None:
                        x.mul_(float(inv))
                    if clip is not None:
                        x.mul_(clip)
                    mean.add_(x)
                mean.div_(3)
                reference_adam(master[group], mean, exp_avg[group], exp_avg_sq[group],
                               window + 1, HPARAMS[group])
                assert torch.equal(cpu.states.master[group], master[group]), (window, group)
                assert torch.equal(cpu.states.exp_avg[group], exp_avg[group])
                assert torch.equal(cpu.states.exp_avg_sq[group], exp_avg_sq[group])
                assert torch.equal(cpu.upload[group], master[group].to(torch.bfloat16))
        assert cpu.states.steps == 3
    finally:
        cpu.close()


def test_windows_alternate_between_two_accumulators():
    """Window 1 fills the other accumulator while window 0's update is held on its thread;
    each update sees its own window's mean; window 2 overwrites accumulator 0."""
    cpu = CpuWorker({0: 6}, torch.float32, pin=False)
    cpu.trace = []
    entered, release = threading.Event(), threading.Event()

    def hold():  # the update thread's wait before it writes the upload buffers
        if threading.current_thread().name.startswith("zenflow-adam") and not release.is_set():
            entered.set()
            release.wait(30)

    def full(value):
        return torch.full((6,), float(value))
    try:
        cpu.set_masters({0: torch.zeros(6)})
        cpu.upload_guard = hold
        cpu.accumulate(0, {0: full(1)}, None, None)
        cpu.accumulate(0, {0: full(3)}, None, None, last=True)
        update = cpu.submit_update(0, 0, [HPARAMS[0]])
        assert entered.wait(30)
        cpu.accumulate(1, {0: full(10)}, None, None).result(timeout=30)
        assert not update.done()  # window 1 accumulated while window 0's update waits
        assert cpu.acc_steps == [2, 1] and cpu.acc_is_mean == [True, False]
        assert torch.equal(cpu.acc[0][0], full(2)) and torch.equal(cpu.acc[1][0], full(10))
        assert cpu.acc[0][0].data_ptr() != cpu.acc[1][0].data_ptr()
        release.set()
        cpu.wait_update()
        assert cpu.acc_steps == [0, 1]  # window 0's accumulator is free, window 1 open
        cpu.accumulate(1, {0: full(20)}, None, None, last=True)
        cpu.submit_update(1, 1, [HPARAMS[0]])
        cpu.wait_update()
        assert cpu.acc_steps == [0, 0]
        assert [w for w, _ in cpu.trace] == [0, 1]
        assert torch.equal(cpu.trace[0][1][0], full(2))
        assert torch.equal(cpu.trace[1][1][0], full(15))
        cpu.accumulate(0, {0: full(5)}, None, None).result(timeout=30)
        assert torch.equal(cpu.acc[0][0], full(5))  # the first step overwrites (0 + grad)
        assert cpu.states.steps == 2
    finally:
        release.set()
        cpu.close()


def test_an_error_on_the_accumulate_thread_reaches_the_caller():
    cpu = CpuWorker({0: 4, 1: 2}, torch.float32, pin=False)
    try:
        missing = cpu.accumulate(0, {0: torch.ones(4)}, None, None, last=True)
        with pytest.raises(RuntimeError, match="param group 1: grads missing"):
            missing.result(timeout=30)
        with pytest.raises(RuntimeError, match="grads missing"):
            cpu.wait_accumulate()
        # The window's update waits for that accumulation, and fails with it.
        cpu.submit_update(0, 0, HPARAMS)
        with pytest.raises(RuntimeError, match="grads missing"):
            cpu.wait_update()

        def copy_failed():
            raise OSError("the D2H copy failed")
        failed = cpu.accumulate(1, {0: torch.ones(4), 1: torch.ones(2)}, None, None,
                                ready=copy_failed, last=True)
        with pytest.raises(OSError, match="D2H copy failed"):
            failed.result(timeout=30)
    finally:
        cpu.close()


class _FailingStates(HostCpuStates):
    """Host states whose Adam step fails (a tier that vanished, say)."""

    def update(self, grads, hparams):
        raise ValueError("the states are gone")


def test_an_error_on_the_update_thread_reaches_the_caller():
    cpu = CpuWorker({0: 4}, torch.float32, pin=False, states=_FailingStates())
    try:
        cpu.set_masters({0: torch.ones(4)})
        cpu.accumulate(0, {0: torch.ones(4)}, None, None, last=True)
        future = cpu.submit_update(0, 0, [HPARAMS[0]])
        with pytest.raises(ValueError, match="the states are gone"):
            cpu.wait_update()
        assert future.done() and cpu.update_pending
        with pytest.raises(ValueError, match="the states are gone"):  # not lost: again
            cpu.wait_update()
    finally:
        cpu.close()


def test_the_knobs_reach_the_worker(monkeypatch):
    """Given by the run's config, or read from the environment when none is given."""
    knobs = ZenFlowConfig(zenflow_threads=3, zenflow_jitter=0.002, zenflow_cpus="all")
    cpu = CpuWorker({0: 2}, torch.float32, pin=False, knobs=knobs)
    try:
        assert cpu.threads == 3 and cpu.jitter == 0.002 and cpu.cpus is None
    finally:
        cpu.close()
    monkeypatch.setenv("MEGATRON_EXT_ZENFLOW_THREADS", "5")
    monkeypatch.setenv("MEGATRON_EXT_NO_HOST_KERNELS", "1")
    cpu = CpuWorker({0: 2}, torch.float32, pin=False)
    try:
        assert cpu.threads == 5 and cpu._kernels is None
    finally:
        cpu.close()
    monkeypatch.setenv("MEGATRON_EXT_ZENFLOW_THREADS", "many")
    with pytest.raises(UsageError, match="MEGATRON_EXT_ZENFLOW_THREADS=many: give a whole "
                                         "number of threads, at least 1"):
        CpuWorker({0: 2}, torch.float32, pin=False)
