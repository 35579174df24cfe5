"""ZenFlow's CPU worker: the delayed columns' accumulators, the upload buffers and two threads.

Two single-thread pools keep the order simple: the accumulate thread adds the steps'
gradients (arriving in the training dtype) into the open window's fp32 accumulator, in
step order; the update thread runs Adam on a closed window once its last accumulation is
done (on the fp32 states of :mod:`.cpu_states`, wherever they are kept). Steps are added a
few at a time (``batch_steps``, at most up to the window's end): one pass reads and
writes the accumulator once for all of them, which is what the host's memory bandwidth,
shared with the previous window's Adam, pays for. Windows alternate between two
accumulators, so window ``w + 1`` accumulates while window ``w`` is being applied; the
optimizer waits for window ``w``'s update before it closes window ``w + 1``, so an
accumulator is never written while it is read. With the sum kept on the model's device
(``--zenflow-accumulate device``: ``accumulation.DeviceAccumulator``) a window's mean
arrives whole in its accumulator by one copy (:meth:`CpuWorker.deposit`), and the
accumulate thread only waits for that copy before the window's update may start.

torch's CPU kernels release the GIL, so both threads run beside the training loop.
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, NamedTuple, Optional

import torch

from megatron_ext.optim.adamw import unscale_and_clip
from megatron_ext.runtime import host_kernels
from megatron_ext.runtime.faults import crash_point
from megatron_ext.zenflow.config import ZenFlowConfig
from megatron_ext.zenflow.cpu_affinity import default_threads, host_cpus
from megatron_ext.zenflow.cpu_states import CpuStates, HostCpuStates
from megatron_ext.zenflow.moves import Fill, Move

ACCUMULATE_CHUNK = 1 << 24
"""Elements converted to fp32 at a time when a step's grads are accumulated (64 MB)."""


class _Queued(NamedTuple):
    """One step waiting to be accumulated."""

    buffer: int
    grads: Dict[int, torch.Tensor]
    inv_scale: Optional[float]
    clip: Optional[float]
    ready: Optional[Callable[[], None]]
    done: Optional[Callable[[], None]]
    last: bool
    future: Future


class _StepFuture(Future):
    """A step's accumulation; waiting for one that is still queued starts its batch."""

    def __init__(self, owner: "CpuWorker"):
        super().__init__()
        self._owner = owner

    def result(self, timeout=None):
        if not self.done():
            self._owner.kick()
        return super().result(timeout)


class CpuWorker:
    """The CPU side's threads, two accumulators and the upload buffers per param group.

    The fp32 masters and Adam moments are ``states`` (:class:`~.cpu_states.CpuStates`:
    in host memory by default, or in the offload tiers); the worker's update thread runs
    their Adam step on a window's mean. On GPU machines (``pin``), the weights waiting to
    enter the model are in page-locked memory (fast H2D copies).

    ``knobs``: the run's :class:`~megatron_ext.zenflow.config.ZenFlowConfig`, whose knobs
    give the threads' CPUs, the accumulation's threads, the test jitter and whether the C
    kernel is used; by default one made now (from the environment: tests, benchmarks).
    """

    def __init__(self, sizes: Dict[int, int], model_dtype: torch.dtype, pin: bool, *,
                 states: Optional[CpuStates] = None, knobs: Optional[ZenFlowConfig] = None):
        knobs = knobs if knobs is not None else ZenFlowConfig()
        self.states = states if states is not None else HostCpuStates(fused=pin)
        """The fp32 masters and Adam moments (the only way to them)."""
        self.model_dtype = model_dtype
        self.pin = pin
        self.upload_guard: Optional[Callable[[], None]] = None
        """Called before the upload buffers are written (the owner's wait for an
        asynchronous copy still reading them)."""
        self.after_update: Optional[Callable[[], None]] = None
        """Called on the update thread once an update has written the upload buffers (the
        owner starts their copy to the device there, before the window's boundary)."""
        self._pinned: Dict[tuple, torch.Tensor] = {}
        self.pin_acc = False
        """Page-locked accumulators (set by :meth:`pin_accumulators`)."""
        self.shared_acc = False
        """Both windows' accumulators are one buffer (set by :meth:`share_accumulators`)."""
        self.last_update_s = 0.0
        """Thread time of the last finished CPU update (Adam over the delayed columns)."""
        self._scratch = threading.local()
        self.acc: List[Dict[int, torch.Tensor]] = [{}, {}]
        self.acc_steps = [0, 0]
        self.acc_is_mean = [False, False]
        """Whether an accumulator holds its window's mean already (divided by its last step)."""
        self.upload: Dict[int, torch.Tensor] = {}
        """The last update's new weights in the model's dtype, waiting to enter the model."""
        self.resize(sizes)
        self.cpus = host_cpus(knobs.zenflow_cpus, default=pin)
        """CPUs of the CPU side's threads (:func:`~.cpu_affinity.host_cpus`), None: all."""
        pin = (lambda: os.sched_setaffinity(0, self.cpus)) if self.cpus else None
        self._acc_pool = ThreadPoolExecutor(1, thread_name_prefix="zenflow-acc", initializer=pin)
        self._update_pool = ThreadPoolExecutor(1, thread_name_prefix="zenflow-adam",
                                               initializer=pin)
        self._last_acc: Optional[Future] = None
        self._queued: List[_Queued] = []
        """Steps whose accumulation has not been submitted yet (one batch, one buffer)."""
        self.batch_steps = 1
        """Steps added in one pass (the owner sets it; a window's last step ends a batch)."""
        self._update: Optional[Future] = None
        self.jitter = knobs.zenflow_jitter
        self._random = random.Random(1234)
        self.lock = threading.Lock()
        self.busy = {"accumulate": 0.0, "update": 0.0}
        self._kernels = None if knobs.zenflow_no_host_kernels else host_kernels.load()
        self.threads = default_threads(knobs.zenflow_threads, self.cpus,
                                       torch.get_num_threads())
        """Threads of one accumulation (the C kernel's; torch's pool otherwise); by default
        no more than the CPU side's CPUs."""
        self.trace: Optional[List[tuple]] = None
        """Test hook: when a list, each update appends (window, [per-group mean grads])."""

    def _empty(self, n: int, dtype=torch.float32) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype)

    def _upload_buffers(self, sizes: Dict[int, int]) -> Dict[int, torch.Tensor]:
        """The upload buffers: page-locked on GPU machines (:meth:`_pinned_views`)."""
        if not self.pin:
            return {g: self._empty(n, self.model_dtype) for g, n in sizes.items()}
        return self._pinned_views("upload", sizes, self.model_dtype)

    def _pinned_views(self, name, sizes: Dict[int, int], dtype: torch.dtype
                      ) -> Dict[int, torch.Tensor]:
        """Views of per-group page-locked buffers named ``name``, kept across re-selections.

        A buffer is replaced (with 1% headroom) only when a group outgrows it: page-locked
        allocations are registered for the life of the process. Not zeroed.
        """
        from megatron_ext.offload.blockio import aligned_empty

        out = {}
        for group, n in sizes.items():
            buf = self._pinned.get((name, group))
            if buf is None or buf.numel() < n:
                self._pinned.pop((name, group), None)
                size = int(n * 1.01) + 1
                buf = self._pinned[(name, group)] = aligned_empty(
                    size * torch.empty((), dtype=dtype).element_size(), dtype, pin=True)
            out[group] = buf[:n]
        return out

    def _acc_buffers(self, index: int, sizes: Dict[int, int]) -> Dict[int, torch.Tensor]:
        """Accumulator ``index``'s buffers.

        Zero, or page-locked with ``pin_acc`` (where the device's window sums arrive by
        asynchronous copies and overwrite them whole: not zeroed).
        """
        if self.pin_acc and self.pin:
            return self._pinned_views(("acc", index), sizes, torch.float32)
        return {g: self._empty(n) for g, n in sizes.items()}

    def share_accumulators(self) -> None:
        """One host buffer for both windows' accumulators from now on (device accumulation).

        There a window's mean arrives whole at its end (:meth:`deposit`), and the caller
        copies it only once the previous window's update has read its own (it waits for
        :meth:`wait_update` first): the host holds one fp32 copy of the delayed columns,
        not two (the memory plan's "ZenFlow window mean"). The accumulator that holds a
        partial window (a checkpoint's) keeps its content.
        """
        if self.shared_acc:
            return
        live = [index for index, steps in enumerate(self.acc_steps) if steps]
        if len(live) > 1:  # two windows' sums (never between windows): keep both
            return
        self.shared_acc = True
        keep = live[0] if live else 0
        self.acc[0], self.acc[1] = self.acc[keep], dict(self.acc[keep])

    def pin_accumulators(self) -> None:
        """Page-locked accumulators from now on (device accumulation on a GPU).

        Their content is kept (one buffer for both after :meth:`share_accumulators`).
        """
        if self.pin_acc:
            return
        self.pin_acc = True
        for index, store in enumerate(self.acc[:1] if self.shared_acc else self.acc):
            new = self._acc_buffers(index, {g: t.numel() for g, t in store.items()})
            for group, tensor in new.items():
                tensor.copy_(store[group])
            store.clear()
            store.update(new)
        if self.shared_acc:
            self.acc[1] = dict(self.acc[0])

    def _guard_upload(self) -> None:
        if self.upload_guard is not None:
            self.upload_guard()

    def _fresh_window_buffers(self, sizes: Dict[int, int]) -> None:
        """Zero accumulators and upload buffers of the per-group ``sizes``."""
        self._guard_upload()
        for store in self.acc:  # the old buffers go before the new ones are allocated
            store.clear()
        self.acc[0].update(self._acc_buffers(0, sizes))
        self.acc[1].update(self.acc[0] if self.shared_acc else self._acc_buffers(1, sizes))
        self.upload = self._upload_buffers(sizes)
        self.acc_steps = [0, 0]
        self.acc_is_mean = [False, False]

    def resize(self, sizes: Dict[int, int]) -> None:
        """Fresh (zero) buffers and states for the given per-group sizes."""
        self._fresh_window_buffers(sizes)
        self.states.resize(sizes, self.upload)

    def reselect(self, sizes: Dict[int, int], fill: Fill) -> None:
        """Fresh accumulators and upload buffers of the new ``sizes``; states from ``fill``.

        ``fill(group, start, length, [master, exp_avg, exp_avg_sq])`` writes the new
        states and may read the old ones (:meth:`CpuStates.read`). Only between windows:
        every accumulator has been consumed.
        """
        self._fresh_window_buffers(sizes)
        self.states.replace(sizes, self.upload, fill)

    def move(self, move: Move) -> Dict[str, Dict[int, torch.Tensor]]:
        """A re-selection's move of every state element; the GPU side's new states.

        The states make it their way (:meth:`CpuStates.move`: whole groups in host memory,
        segment by segment in the offload tiers); fresh accumulators and upload buffers of
        the new sizes. Only between windows: every accumulator has been consumed.
        """
        return self.states.move(move, self._renew)

    def _renew(self, sizes: Dict[int, int]) -> Dict[int, torch.Tensor]:
        """Fresh accumulators and upload buffers of the new ``sizes``; the upload buffers."""
        self._fresh_window_buffers(sizes)
        return self.upload

    # ------------------------------------------------------------ tasks

    def _sleep(self) -> None:
        if self.jitter:
            with self.lock:
                delay = self._random.uniform(0, self.jitter)
            time.sleep(delay)

    def _timed(self, key: str, fn: Callable) -> Callable:
        def run():
            self._sleep()
            start = time.perf_counter()
            try:
                return fn()
            finally:
                with self.lock:
                    self.busy[key] += time.perf_counter() - start
        return run

    def accumulate(self, buffer: int, grads: Dict[int, torch.Tensor], inv_scale, clip_coeff,
                   ready: Optional[Callable[[], None]] = None,
                   done: Optional[Callable[[], None]] = None, last: bool = False) -> Future:
        """Adds one step's grads (training dtype, host) into accumulator ``buffer``.

        ``ready`` is waited for first (the D2H copy); ``done`` is called after (the
        staging buffer is free again). The first step of a window overwrites the
        accumulator (``0 + grad``: no zeroing pass); with ``last`` (the window's last step)
        the sum is divided by the window's step count on the way (the mean Adam takes; no
        separate division pass).

        The step is queued until ``batch_steps`` steps are, or ``last``, or someone waits
        for it (the returned future's ``result``, :meth:`kick`, :meth:`wait_accumulate`):
        then the queued steps are added in one pass, in step order, with the same roundings
        as one pass per step.
        """
        if self._queued and self._queued[0].buffer != buffer:
            self.kick()
        future = _StepFuture(self)
        inv = float(inv_scale) if inv_scale is not None else None
        clip = float(clip_coeff) if clip_coeff is not None else None
        self._queued.append(_Queued(buffer, grads, inv, clip, ready, done, last, future))
        if last or len(self._queued) >= max(1, self.batch_steps):
            self.kick()
        return future

    def kick(self) -> None:
        """Submits the queued steps' accumulation (one pass) to the accumulate thread."""
        with self.lock:
            batch, self._queued = self._queued, []
        if not batch:
            return

        def task():
            try:
                crash_point("zenflow-worker")
                for entry in batch:
                    if entry.ready is not None:
                        entry.ready()
                self._add_steps(batch)
            except BaseException as exc:
                for entry in batch:
                    entry.future.set_exception(exc)
                raise
            for entry in batch:
                if entry.done is not None:
                    entry.done()
                entry.future.set_result(None)
        self._last_acc = self._acc_pool.submit(self._timed("accumulate", task))

    def deposit(self, buffer: int, steps: int, ready: Optional[Callable[[], None]]) -> Future:
        """Accumulator ``buffer`` receives a whole window's mean (device accumulation).

        ``ready`` (waited for on the accumulate thread, in order with the other tasks)
        says the copy into the buffer has finished; the window counts ``steps`` steps. An
        update submitted after this waits for it like for a last accumulation.
        """
        self.kick()

        def task():
            crash_point("zenflow-worker")
            if ready is not None:
                ready()
            self.acc_steps[buffer] = steps
            self.acc_is_mean[buffer] = True
        self._last_acc = self._acc_pool.submit(task)
        return self._last_acc

    def _add_steps(self, batch: List[_Queued]) -> None:
        """Adds the batch's steps (one buffer, step order) into its accumulator."""
        buffer = batch[0].buffer
        first = self.acc_steps[buffer] == 0
        count = self.acc_steps[buffer] + len(batch)
        last = batch[-1].last
        divisor = count if last and count > 1 else None
        invs = [entry.inv_scale for entry in batch]
        clips = [entry.clip for entry in batch]
        for group, acc in self.acc[buffer].items():
            grads = [entry.grads[group] for entry in batch if group in entry.grads]
            if len(grads) != len(batch):
                raise RuntimeError(f"param group {group}: grads missing from a queued step")
            self._add_fp32(acc, grads, invs, clips, first, divisor)
        self.acc_steps[buffer] = count
        self.acc_is_mean[buffer] = last

    def _add_fp32(self, acc: torch.Tensor, grads: List[torch.Tensor],
                  inv_scales: List[Optional[float]], clips: List[Optional[float]],
                  first: bool, divisor: Optional[int]) -> None:
        """``acc = ((0 if first else acc) + sum of unscale_and_clip(fp32(grad))) / divisor``.

        The steps' grads are added in order. One pass of the C kernel
        (runtime/host_kernels.py) where it is available; else torch, a step and a chunk at
        a time through a reused buffer. Both give the same roundings as converting each
        whole gradient first, multiplying, adding and dividing.
        """
        if self._kernels is not None and all(host_kernels.supports(acc, g) for g in grads):
            for start in range(0, len(grads), host_kernels.MAX_STEPS):
                end = start + host_kernels.MAX_STEPS
                host_kernels.accumulate_steps(
                    self._kernels, acc, grads[start:end], inv_scales[start:end],
                    clips[start:end], first=first and start == 0,
                    divisor=divisor if end >= len(grads) else None, threads=self.threads)
            return
        if first:
            acc.zero_()
        for grad, inv_scale, clip_coeff in zip(grads, inv_scales, clips):
            if grad.dtype == torch.float32 and inv_scale is None and clip_coeff is None:
                acc.add_(grad)
                continue
            scratch = getattr(self._scratch, "buffer", None)
            if scratch is None:
                scratch = self._scratch.buffer = torch.empty(ACCUMULATE_CHUNK)
            for start in range(0, grad.numel(), ACCUMULATE_CHUNK):
                part = grad[start:start + ACCUMULATE_CHUNK]
                fp32 = scratch[:part.numel()]
                fp32.copy_(part)
                unscale_and_clip(fp32, inv_scale, clip_coeff)
                acc[start:start + part.numel()].add_(fp32)
        if divisor is not None:
            acc.div_(divisor)

    def _window_mean(self, buffer: int) -> Dict[int, torch.Tensor]:
        """The window's mean grads in accumulator ``buffer`` (divided now if not yet)."""
        if not self.acc_is_mean[buffer] and self.acc_steps[buffer] > 1:
            for grad in self.acc[buffer].values():
                grad.div_(self.acc_steps[buffer])
        return self.acc[buffer]

    def _consumed(self, buffer: int) -> None:
        """Accumulator ``buffer`` is free: the next accumulation into it overwrites it."""
        self.acc_steps[buffer] = 0
        self.acc_is_mean[buffer] = False

    def submit_update(self, buffer: int, window: int, hparams: List[dict]) -> Future:
        """Starts Adam on the window in ``buffer`` (after its last accumulation)."""
        self.kick()
        last = self._last_acc
        hp = [dict(h) for h in hparams]

        def task():
            crash_point("zenflow-worker")
            if last is not None:
                last.result()
            self._guard_upload()
            start = time.perf_counter()
            self._apply_adam(buffer, window, hp)
            self.last_update_s = time.perf_counter() - start
            if self.after_update is not None:
                self.after_update()
        self._update = self._update_pool.submit(self._timed("update", task))
        return self._update

    def set_masters(self, masters: Dict[int, torch.Tensor]) -> None:
        """fp32 masters per group (from the model's weights); moments kept."""
        self.states.set_masters(masters)

    def masters_to_upload(self) -> None:
        """Casts the masters into the upload buffers (their weights enter the model next)."""
        self._guard_upload()
        self.states.write_upload()

    def metrics(self) -> Dict[str, float]:
        """Metrics of the state store since the last call."""
        return self.states.metrics()

    def host_bytes(self) -> int:
        """Host memory of the states and accumulators."""
        # A shared accumulator (share_accumulators) counts once.
        acc = sum(t.numel() * t.element_size()
                  for t in {t.data_ptr(): t for s in self.acc for t in s.values()}.values())
        return self.states.host_bytes() + acc

    def _apply_adam(self, buffer: int, window: int, hparams: List[dict]) -> None:
        """The states' Adam step with the window's mean (the update writes the upload)."""
        means = self._window_mean(buffer)
        if self.trace is not None:
            self.trace.append((window, {g: t.clone() for g, t in means.items()}))
        self.states.update(means, hparams)
        self._consumed(buffer)

    def wait_accumulate(self) -> None:
        """Until every accumulation, queued or submitted, is done."""
        self.kick()
        if self._last_acc is not None:
            self._last_acc.result()

    def wait_update(self) -> bool:
        """Until the submitted update is done; False when there was none."""
        if self._update is None:
            return False
        self._update.result()
        self._update = None
        return True

    @property
    def update_pending(self) -> bool:
        """An update was submitted and not yet waited for."""
        return self._update is not None

    def close(self) -> None:
        """Finishes the queued and submitted tasks, stops the threads, closes the states."""
        self.kick()
        for pool in (self._acc_pool, self._update_pool):
            pool.shutdown(wait=True)
        self.states.close()
