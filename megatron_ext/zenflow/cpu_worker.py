"""ZenFlow's CPU side: the delayed columns' fp32 states, accumulators and Adam.

Two single-thread pools keep the order simple: the accumulate thread adds the steps'
gradients (arriving in the training dtype) into the open window's fp32 accumulator, in
step order; the update thread runs Adam on a closed window once its last accumulation is
done. Steps are added a few at a time (``batch_steps``, at most up to the window's end):
one pass reads and writes the accumulator once for all of them, which is what the host's
memory bandwidth, shared with the previous window's Adam, pays for. Windows alternate
between two accumulators, so window ``w + 1`` accumulates while window ``w`` is being
applied; the optimizer waits for window ``w``'s update before it closes window ``w + 1``,
so an accumulator is never written while it is read. With the sum kept on the model's
device (``--zenflow-accumulate device``: ``accumulation.DeviceAccumulator``) a window's
mean arrives whole in its accumulator by one copy (:meth:`CpuSide.deposit`), and the
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

from megatron_ext.errors import UsageError
from megatron_ext.optim.adamw import adam_update, unscale_and_clip
from megatron_ext.runtime import host_kernels

JITTER_ENV = "MEGATRON_EXT_ZENFLOW_JITTER"
"""Test hook: a maximum delay in seconds, slept at random before each CPU task."""


ACCUMULATE_CHUNK = 1 << 24
"""Elements converted to fp32 at a time when a step's grads are accumulated (64 MB)."""


THREADS_ENV = "MEGATRON_EXT_ZENFLOW_THREADS"


def default_threads() -> int:
    """Threads for one accumulation.

    $MEGATRON_EXT_ZENFLOW_THREADS, else half of torch's intra-op count (OMP_NUM_THREADS,
    CPU affinity), at least one. The accumulation shares the host's memory bandwidth and
    cores with the training loop's own thread (which launches the GPU kernels) and with the
    CPU Adam of the previous window. On the 16-core H200 machine (1.28B GPT, k=0.1, S=4;
    bench/results/2026-11-30-h200-zenflow-bench): 16 threads slowed the loop's kernel
    launches (forward-backward 0.150 s instead of 0.135), 4 could not keep up (25% of the
    time waiting for the host), 8 with three staging slots left no wait at all.
    """
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return max(1, torch.get_num_threads() // 2)
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"{THREADS_ENV}={value}: give a whole number of threads, at least 1")
    return int(value)


CPUS_ENV = "MEGATRON_EXT_ZENFLOW_CPUS"

LOOP_CPUS = 2
"""CPUs per training process that the CPU side's threads leave free by default (on GPUs)."""


def host_cpus(default: bool = False) -> Optional[set]:
    """The CPUs of the CPU side's threads, as a set; None: no confinement.

    $MEGATRON_EXT_ZENFLOW_CPUS: CPU numbers and ranges ("2-15", "1,3,8-11"), a non-empty
    subset of the CPUs this process may use, or "all". Unset: with ``default`` (the GPU
    side is a CUDA device) :func:`default_host_cpus`, else all. The CPU side's threads
    (accumulation, Adam, and the workers they start: the C kernel's threads and torch's
    OpenMP team inherit the mask) run on these CPUs only, so that the training loop's own
    thread, which launches the GPU's kernels, keeps the others.
    """
    value = os.environ.get(CPUS_ENV, "").strip()
    allowed = os.sched_getaffinity(0)
    if not value:
        if not default:
            return None
        return default_host_cpus(allowed, os.cpu_count() or len(allowed), _local_ranks(),
                                 cpu_siblings(allowed))
    if value == "all":
        return None
    try:
        cpus = _parse_cpus(value)
    except ValueError:
        raise UsageError(f"{CPUS_ENV}={value}: give CPU numbers and ranges, e.g. 2-15 or "
                         "1,3,8-11, or all") from None
    if not cpus <= allowed:
        raise UsageError(f"{CPUS_ENV}={value}: CPUs {sorted(cpus - allowed)} are not available "
                         f"to this process (it may use {cpu_ranges(allowed)})")
    return cpus


def default_host_cpus(allowed: set, machine_cpus: int, local_ranks: int,
                      siblings: Optional[Dict[int, set]] = None) -> Optional[set]:
    """All CPUs this process may use but the first LOOP_CPUS per training process on them.

    And but their hyperthread siblings (``siblings``: CPU -> the CPUs of its core, itself
    included; :func:`cpu_siblings`): a host thread on the other hardware thread of a
    loop's core would share that core's execution units and caches with the thread that
    launches the GPU's kernels.

    A process bound to its own CPUs (fewer than the machine's: Slurm's or numactl's
    binding) leaves LOOP_CPUS of them; one that may use the whole machine shares it with the
    other ranks of its node, all of which leave the same first LOOP_CPUS x ranks CPUs to
    their loops' threads. No confinement (None) when fewer CPUs than that would be left to
    the host threads. On the 16-core H200 machine (1.28B GPT, k=0.1, S=4; bench/results/
    2026-12-01b-h200, calls 1 and 4): 0.237 and 0.249 s per step with the host threads on
    every CPU, 0.213 and 0.224 on CPUs 2-15 (0.184 and 0.190 without offload): the loop's
    forward-backward went from 0.143-0.154 s back to 0.133-0.136, the no-offload figure.
    """
    ordered = sorted(allowed)
    sharing = local_ranks if len(ordered) >= machine_cpus else 1
    reserve = LOOP_CPUS * max(1, sharing)
    loop = set(ordered[:reserve])
    for cpu in ordered[:reserve]:
        loop |= set((siblings or {}).get(cpu, ()))
    host = set(ordered) - loop
    if len(host) < reserve:
        return None
    return host


def cpu_siblings(cpus) -> Dict[int, set]:
    """CPU -> the CPUs of its core (Linux's topology/thread_siblings_list); {} unknown."""
    out = {}
    for cpu in cpus:
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        try:
            with open(path) as f:
                out[cpu] = _parse_cpus(f.read().strip())
        except (OSError, ValueError):
            return {}
    return out


def _parse_cpus(text: str) -> set:
    """"0-2,5" -> {0, 1, 2, 5} (raises ValueError)."""
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        first, last = int(lo), int(hi) if hi else int(lo)
        if first < 0 or last < first:
            raise ValueError(part)
        cpus.update(range(first, last + 1))
    return cpus


def _local_ranks() -> int:
    """Training processes on this node (torchrun's LOCAL_WORLD_SIZE, Slurm's tasks)."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def cpu_ranges(cpus) -> str:
    """A set of CPU numbers as taskset writes it: {0, 1, 2, 5} -> "0-2,5"."""
    out, run = [], []
    for cpu in sorted(cpus):
        if run and cpu != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(cpu)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


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

    def __init__(self, owner: "CpuSide"):
        super().__init__()
        self._owner = owner

    def result(self, timeout=None):
        if not self.done():
            self._owner.kick()
        return super().result(timeout)


class CpuSide:
    """fp32 master, Adam moments and two accumulators per param group, on the host.

    On GPU machines (``pin``), the weights waiting to enter the model are in page-locked
    memory (fast H2D copies) and Adam is torch's fused CPU kernel.
    """

    def __init__(self, sizes: Dict[int, int], model_dtype: torch.dtype, pin: bool,
                 threads: Optional[int] = None):
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
        self.last_update_s = 0.0
        """Thread time of the last finished CPU update (Adam over the delayed columns)."""
        self._scratch = threading.local()
        self.master: Dict[int, torch.Tensor] = {}
        self.exp_avg: Dict[int, torch.Tensor] = {}
        self.exp_avg_sq: Dict[int, torch.Tensor] = {}
        self.acc: List[Dict[int, torch.Tensor]] = [{}, {}]
        self.acc_steps = [0, 0]
        self.acc_is_mean = [False, False]
        """Whether an accumulator holds its window's mean already (divided by its last step)."""
        self.upload: Dict[int, torch.Tensor] = {}
        """The last update's new weights in the model's dtype, waiting to enter the model."""
        self.steps = 0
        """Adam steps taken by the CPU side (its bias correction counts these)."""
        self.resize(sizes)
        self.cpus = host_cpus(default=pin)
        """CPUs of the CPU side's threads (:func:`host_cpus`), None: all."""
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
        self.jitter = float(os.environ.get(JITTER_ENV, "0") or 0)
        self._random = random.Random(1234)
        self.lock = threading.Lock()
        self.busy = {"accumulate": 0.0, "update": 0.0}
        self._kernels = host_kernels.load()
        self.threads = threads or default_threads()
        """Threads of one accumulation (the C kernel's; torch's pool otherwise); by default
        no more than the CPUs of $MEGATRON_EXT_ZENFLOW_CPUS."""
        if self.cpus and not os.environ.get(THREADS_ENV, "").strip():
            self.threads = min(self.threads, len(self.cpus))
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
        from megatron_ext.offload.io import aligned_empty

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

    def pin_accumulators(self) -> None:
        """Page-locked accumulators from now on (device accumulation on a GPU).

        Their content is kept.
        """
        if self.pin_acc:
            return
        self.pin_acc = True
        for index, store in enumerate(self.acc):
            new = self._acc_buffers(index, {g: t.numel() for g, t in store.items()})
            for group, tensor in new.items():
                tensor.copy_(store[group])
            store.clear()
            store.update(new)

    def _guard_upload(self) -> None:
        if self.upload_guard is not None:
            self.upload_guard()

    def _fresh_window_buffers(self, sizes: Dict[int, int]) -> None:
        """Zero accumulators and upload buffers of the per-group ``sizes``."""
        self._guard_upload()
        self.sizes = dict(sizes)
        for index, store in enumerate(self.acc):
            store.clear()
            store.update(self._acc_buffers(index, sizes))
        self.upload = self._upload_buffers(sizes)
        self.acc_steps = [0, 0]
        self.acc_is_mean = [False, False]

    def resize(self, sizes: Dict[int, int]) -> None:
        """Fresh (zero) buffers for the given per-group sizes."""
        for store in (self.master, self.exp_avg, self.exp_avg_sq):
            store.clear()
            store.update({g: self._empty(n) for g, n in sizes.items()})
        self._fresh_window_buffers(sizes)

    def replace_states(self, sizes: Dict[int, int], states: Dict[str, Dict[int, torch.Tensor]]
                       ) -> None:
        """New master and moments (re-selection); fresh accumulators of the new sizes.

        Only between windows: every accumulator has been consumed.
        """
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            store = getattr(self, kind)
            store.clear()
            store.update(states[kind])
        self._fresh_window_buffers(sizes)

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
        for group, values in masters.items():
            self.master[group].copy_(values)

    def masters_to_upload(self) -> None:
        """Casts the masters into the upload buffers (their weights enter the model next)."""
        self._guard_upload()
        for group, master in self.master.items():
            self.upload[group].copy_(master)

    def states(self) -> Dict[str, Dict[int, torch.Tensor]]:
        """master, exp_avg, exp_avg_sq per group (for checkpoints and re-selection)."""
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def metrics(self) -> Dict[str, float]:
        """Metrics of the state store since the last call (none in host memory)."""
        return {}

    def host_bytes(self) -> int:
        """Host memory of the states and accumulators."""
        stores = [*self.states().values(), *self.acc]
        return sum(t.numel() * t.element_size() for s in stores for t in s.values())

    def _apply_adam(self, buffer: int, window: int, hparams: List[dict]) -> None:
        means = self._window_mean(buffer)
        self.steps += 1
        for group in self.sizes:
            adam_update(self.master[group], means[group], self.exp_avg[group],
                        self.exp_avg_sq[group], self.steps, hparams[group], fused=self.pin)
            self.upload[group].copy_(self.master[group])
        if self.trace is not None:
            self.trace.append((window, {g: t.clone() for g, t in means.items()}))
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
        """Finishes the queued and submitted tasks and stops the threads."""
        self.kick()
        for pool in (self._acc_pool, self._update_pool):
            pool.shutdown(wait=True)


class TieredCpuSide(CpuSide):
    """The CPU side with its fp32 master and moments in the offload engine.

    The engine keeps them in its host cache and in files on the ``--offload-paths``
    directories, one "parameter" per param group (the group's compact delayed columns):
    a window's update is one engine step over all subgroups, with the window's mean
    gradients (the fp32 accumulator) as the gradients and the upload buffers as the model
    weights it writes. Accumulators and upload buffers stay in host memory.
    """

    def __init__(self, sizes: Dict[int, int], model_dtype: torch.dtype, pin: bool,
                 make_engine: Callable):
        self._make_engine = make_engine
        """``make_engine(params, generation)``: an offload engine whose files do not collide
        with those of another generation (re-selection fills a new engine from the old)."""
        self.engine = None
        self._source = None
        """(engine, its groups) that read_states reads while reselect fills a new engine."""
        self.generation = 0
        self._buffer = 0
        self._init: Dict[int, torch.Tensor] = {}
        super().__init__(sizes, model_dtype, pin)

    def _new_engine(self, sizes: Dict[int, int]):
        from megatron_ext.offload.engine import ShardParam

        params = [ShardParam(numel=n, group=g, grad=lambda g=g: self.acc[self._buffer][g],
                             out=self.upload[g], init=lambda g=g: self._init[g])
                  for g, n in sorted(sizes.items())]
        return self._make_engine(params, self.generation)

    def resize(self, sizes: Dict[int, int]) -> None:
        """A fresh engine for the per-group sizes; fresh accumulators."""
        self._fresh_window_buffers(sizes)
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if sizes:
            self.engine = self._new_engine(sizes)

    def read_states(self, group: int, start: int, length: int,
                    outs: List[torch.Tensor]) -> None:
        """Some of one group's states (fp32, in its compact order) into ``outs``.

        Elements ``[start, start + length)`` of ``group``'s master, exp_avg and exp_avg_sq
        go into the three tensors; during :meth:`reselect`, the replaced engine's.
        """
        engine, groups = self._source or (self.engine, sorted(self.sizes))
        engine.read_states(groups.index(group), start, length, outs)

    def replace_states(self, sizes, states) -> None:
        """Not this mode's way: the states move with :meth:`reselect`."""
        raise NotImplementedError("the CPU side in the offload tiers re-selects with reselect()")

    def reselect(self, sizes: Dict[int, int],
                 fill: Callable[[int, int, int, List[torch.Tensor]], None]) -> None:
        """A new engine for the new per-group ``sizes``; then the old one and its files go.

        Its states are written by ``fill(group, start, length, [master, exp_avg,
        exp_avg_sq])``, which may read the old engine's with :meth:`read_states`.

        Only between windows (every accumulator consumed). Both engines' files are on the
        paths while the states move (each engine under its own directory); the Adam step
        count carries over.
        """
        old = self.engine
        self._source = (old, sorted(self.sizes)) if old is not None else None
        self.generation += 1
        self._fresh_window_buffers(sizes)
        groups = sorted(sizes)
        try:
            if sizes:
                self.engine = self._new_engine(sizes)
                self.engine.initialize_from(
                    lambda param, start, length, views: fill(groups[param], start, length,
                                                             views),
                    step=old.step_count if old is not None else 0)
            else:
                self.engine = None
        finally:
            self._source = None
        if old is not None:
            old.close()

    def set_masters(self, masters: Dict[int, torch.Tensor]) -> None:
        """The engine's masters from ``masters`` (zero moments on the first call)."""
        if self.engine is None:
            return
        self._init = masters
        try:
            if self.engine.initialized:
                self.engine.reset_masters_from_model()
            else:
                self.engine.initialize_from_model()
        finally:
            self._init = {}

    def masters_to_upload(self) -> None:
        """The engine's masters, cast, into the upload buffers."""
        self._guard_upload()
        if self.engine is not None:
            self.engine.write_all_params()

    def states(self) -> Dict[str, Dict[int, torch.Tensor]]:
        """Not in host memory: the engine saves its files with the checkpoint."""
        return {}

    def metrics(self) -> Dict[str, float]:
        """The engine's ``offload/*`` metrics since the last call."""
        return self.engine.metrics() if self.engine is not None else {}

    def host_bytes(self) -> int:
        """Accumulators, upload buffers and the engine's host cache."""
        total = sum(t.numel() * t.element_size() for s in self.acc for t in s.values())
        if self.engine is not None:
            total += len(self.engine.cache) * self.engine.max_numel * 12
        return total

    def _apply_adam(self, buffer: int, window: int, hparams: List[dict]) -> None:
        means = self._window_mean(buffer)
        if self.trace is not None:
            self.trace.append((window, {g: t.clone() for g, t in means.items()}))
        if self.engine is not None:
            self._buffer = buffer
            self.engine.step(hparams, None, None)
        self.steps += 1
        self._consumed(buffer)

    def close(self) -> None:
        """Stops the threads and the engine (its tier files are removed)."""
        super().close()
        if self.engine is not None:
            self.engine.close()
