"""The update pipeline of the offload engine.

One rank's optimizer shard is cut into subgroups (:mod:`.subgroups`). Each subgroup's
state (master weights, exp_avg, exp_avg_sq: one buffer in the layout of :mod:`.states`;
with bf16 weights the masters are 16-bit remainders beside them, :mod:`.remainders`)
lives in the device tier, the host cache (:mod:`.cache`) or a file on one of the tier
paths (where: :mod:`.plan`; the bytes: :mod:`.store`, :mod:`.io`). A step walks the
subgroups (ascending, then descending on the next step: alternating order) and for each
one, overlapped with threads:

    prefetch k+1 from its path  |  update k: gradients to the host in the training dtype,
                                |  converted to fp32 here (delayed conversion), CPU Adam,
                                |  new weights back to the model in its dtype
    flush an evicted subgroup   |

The engine is the orchestrator: the tier plan (:mod:`.plan`) says where each subgroup
lives and who updates it, the store (:mod:`.store`) moves the bytes, the updaters
(:mod:`.updaters`) run Adam, and :mod:`.checkpoint` saves and loads. A step is: plan ->
prefetch -> update -> write back -> rebalance.

Nothing fp32 of the shard stays on the model's device. The engine is device-agnostic:
with CPU tensors it runs in CI; with CUDA it uses pinned buffers, copy streams and events.
It never imports megatron-core: :mod:`.optimizer` hands it the shard's tensors.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence

import torch

from megatron_ext.errors import UsageError
from megatron_ext.offload import checkpoint
from megatron_ext.offload.blockio import aligned_empty
from megatron_ext.offload.cache import HostCache
from megatron_ext.offload.config import OffloadConfig
from megatron_ext.offload.engine_metrics import EngineMetrics
from megatron_ext.offload.jobdir import JobDirs
from megatron_ext.offload.masters import convert, read_masters, store_masters
from megatron_ext.offload.paths import TierSpec
from megatron_ext.offload.plan import TierPlan, gb
from megatron_ext.offload.staging import (
    HostWriteBack,
    StagedWriteBack,
    gather_params,
    gradient_source,
    scatter,
)
from megatron_ext.offload.states import StateLayout
from megatron_ext.offload.store import StepStats, SubgroupStore
from megatron_ext.offload.subgroups import ShardParam, Subgroup, layout_fingerprint, partition
from megatron_ext.offload.tier_model import Tier, Updater
from megatron_ext.offload.updaters import (
    CpuUpdater,
    DeviceUpdater,
    StepArgs,
    SubgroupAdam,
    stream_updater,
)
from megatron_ext.runtime.faults import Faults

log = logging.getLogger(__name__)

class OffloadEngine:
    """Owns the fp32 state of one rank's shard and updates it subgroup by subgroup."""

    def __init__(self, cfg: OffloadConfig, params: Sequence[ShardParam], *, rank: int,
                 device: torch.device, tiers: Sequence[TierSpec], run_id: str,
                 model_dtype: torch.dtype, grad_dtype: torch.dtype,
                 layout: Optional[StateLayout] = None, faults: Faults = Faults(),
                 params_are_model: bool = True,
                 device_budget_bytes: Optional[int] = None):
        """Plans the tiers, opens the store and builds the updaters of this run.

        Args:
            cfg: the engine's config (its knobs included).
            params: the shard's parameters.
            rank: this data-parallel rank.
            device: the model's device.
            tiers: the paths, with their bandwidths.
            run_id: this job's directory name under each path.
            model_dtype: the model weights' dtype.
            grad_dtype: the gradients' dtype.
            layout: the dtypes the states are stored in (fp32 by default); the masters are
                stored as remainders where ``cfg.store_param_remainders`` and the dtypes
                allow it (:meth:`StateLayout.remainders_apply`).
            faults: faults the test suite injects (none by default).
            params_are_model: whether the params' ``out`` are the model's weights (the
                offload optimizer) or buffers of the caller's (ZenFlow's upload buffers):
                a load that turns whole masters into remainders checks the former against
                the masters and sets the latter.
            device_budget_bytes: with ``--offload-device-cache-gb auto``, the device bytes
                the device tier may take before the first step (the memory plan's GPU
                budget); None: the first step sizes it.
        """
        self.cfg = cfg
        layout = layout or StateLayout()
        self.layout = layout.with_remainders(bool(cfg.store_param_remainders)
                                             and layout.remainders_apply(model_dtype))
        self.params_are_model = params_are_model
        self.params = list(params)
        self.rank = rank
        self.device = device
        self.model_dtype, self.grad_dtype = model_dtype, grad_dtype
        numels = [p.numel for p in self.params]
        groups = [p.group for p in self.params]
        self.subgroups: List[Subgroup] = partition(numels, groups, cfg.offload_subgroup_size)
        self.fingerprint = layout_fingerprint(numels, groups, cfg.offload_subgroup_size)
        self.max_numel = max((sg.numel for sg in self.subgroups), default=0)
        self._param_pieces: Optional[Dict[int, list]] = None
        self.total_numel = sum(numels)
        self.initialized = False
        # DIR/megatron_ext-USER/JOB/rankNNNNN per path: checked and locked first (a path
        # too full for even that is skipped, with a warning).
        jobdirs = JobDirs([t.path for t in tiers], run_id, rank)
        self.tiers = [t for t in tiers if t.path in jobdirs.bases]
        self.stats = StepStats(len(self.tiers))
        self._metrics = EngineMetrics(len(self.tiers))
        # Bytes of each subgroup's state (its file's payload), in the layout's dtypes.
        self.sizes = [self.layout.nbytes(sg.numel) for sg in self.subgroups]
        self.buffer_bytes = self.layout.nbytes(self.max_numel)
        self.tier_plan = TierPlan(cfg, [sg.numel for sg in self.subgroups], self.sizes,
                                  self.buffer_bytes, tiers=self.tiers, rank=rank, device=device,
                                  device_budget_bytes=device_budget_bytes)
        is_cuda = device.type == "cuda"
        # GPU machines: the one-pass host AdamW (runtime/host_kernels.py), several times
        # faster than torch's reference and the same bits however the states are cut. A CPU
        # run takes the reference: megatron-core's own optimizer there, bit for bit.
        self.adam = SubgroupAdam(self.subgroups, self.layout, fused=is_cuda)
        param_dtype = model_dtype if self.layout.remainders else None
        self.write_back = (StagedWriteBack(self.params, self.subgroups, self.layout,
                                           self.max_numel, device, model_dtype) if is_cuda
                           else HostWriteBack(self.params, self.subgroups))
        self.store = SubgroupStore(cfg, self.tiers, jobdirs, self.tier_plan, rank=rank,
                                   device=device, subgroups=self.subgroups, layout=self.layout,
                                   stats=self.stats, faults=faults,
                                   wait_readers=self.write_back.wait_readers)
        plan = self.tier_plan
        self.on_device = DeviceUpdater(
            self.params, self.subgroups, self.adam, self.stats, device=device,
            max_numel=self.max_numel,
            allocate=is_cuda and bool(plan.device_auto or plan.device_members
                                      or cfg.offload_gpu_update),
            param_dtype=param_dtype)
        self.streamed = stream_updater(self.on_device, self.store, cfg.offload_gpu_update)
        if is_cuda and plan.device_auto:
            # megatron-core's optimizer made fp32 masters of the whole shard on the device
            # and the base class freed them: that transient is no training peak (nor are
            # their cached blocks: the first sizing measures the reserved peak).
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        grads = gradient_source(cfg.offload_delayed_grad_conversion, self.params,
                                self.subgroups, self.max_numel, device=device,
                                grad_dtype=grad_dtype, store=self.store,
                                param_dtype=param_dtype)
        self.cpu = CpuUpdater(self.subgroups, grads, self.adam, self.write_back, self.stats)
        self.updaters = {Updater.DEVICE: self.on_device, Updater.STREAM: self.streamed,
                         Updater.CPU: self.cpu}
        if rank == 0:
            log.info("offload: optimizer states of %d elements per rank in %d subgroups, %s",
                     self.total_numel, len(self.subgroups), self.layout.describe())

    # ----------------------------------------------------------------- views of the parts

    @property
    def step_count(self) -> int:
        """The Adam steps the states have taken (the store's clock: files, faults)."""
        return self.store.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.store.step_count = value

    @property
    def fused_adam(self) -> bool:
        """Torch's fused kernel for host states (ZenFlow's CPU side sets it on GPU hosts)."""
        return self.adam.fused

    @fused_adam.setter
    def fused_adam(self, value: bool) -> None:
        self.adam.fused = value

    @property
    def cache(self) -> HostCache:
        """The host cache of subgroup buffers."""
        return self.store.cache

    @property
    def location(self) -> List[Optional[int]]:
        """The path of each subgroup's current file (None: never written)."""
        return self.store.location

    @property
    def rank_dirs(self) -> List[str]:
        """The rank's directory on each path."""
        return self.store.rank_dirs

    @property
    def home(self) -> List[Optional[int]]:
        """Each subgroup's path (-1: host cache only; None: no paths)."""
        return self.tier_plan.home

    @property
    def resident(self) -> FrozenSet[int]:
        """Subgroups that live in the host cache only (no file), never evicted."""
        return self.tier_plan.resident

    @property
    def device_members(self) -> List[int]:
        """The device tier's subgroups, in the order they joined."""
        return self.tier_plan.device_members

    def _views(self, buffer: torch.Tensor, index: int) -> List[torch.Tensor]:
        """[master, exp_avg, exp_avg_sq] of subgroup ``index`` in a state buffer."""
        return self.store.views(buffer, index)

    def _acquire_sync(self, index: int) -> torch.Tensor:
        """Subgroup ``index``'s state buffer: its device state, or a host buffer (fetched)."""
        return self.store.acquire(index)

    def tier_of(self, index: int) -> Tier:
        """Where subgroup ``index``'s state lives now."""
        return self.tier_plan.tier_of(index, index in self.store.cache,
                                      self.store.location[index])

    def device_bytes(self) -> int:
        """Bytes of state in the device tier."""
        return self.tier_plan.device_bytes()

    def stream_share(self) -> float:
        """The share of the host subgroups' elements the device updates this step."""
        return self.tier_plan.stream_share()

    def plan(self, order: Sequence[int]) -> Dict[int, Updater]:
        """Who updates each subgroup this step (the tier model's decision)."""
        return self.tier_plan.assign(order)

    def order(self, step: int) -> List[int]:
        """Subgroup order of ``step`` (1-based): with alternation, descending on odd steps."""
        ids = list(range(len(self.subgroups)))
        if self.cfg.offload_alternate_order and step % 2 == 1:
            ids.reverse()
        return ids

    def wait_io(self) -> None:
        """Waits for every background flush; raises the first error one of them hit."""
        self.store.wait_io()

    # ----------------------------------------------------------------- the device tier

    def _size_device_tier(self) -> None:
        """``auto``: sizes the device tier at the first step, gives back later.

        At the first step the measured peak sizes it (from the memory plan's budget, if it
        started with one: it grows or shrinks); a later peak only takes memory back.
        """
        plan = self.tier_plan
        if not plan.device_auto:
            return
        limit, peak = plan.memory(self.step_count, self.store.device_state_bytes())
        reserve = int(self.cfg.offload_device_reserve_gb * 1e9)
        others = max(0, peak - plan.device_bytes())  # what the iteration needs besides
        before = len(plan.device_members)
        joining, leaving = plan.resize_device(limit, peak)
        for index in joining:
            if self.initialized:
                self.store.promote(index)
            plan.join(index)
        for index in leaving:
            plan.leave(index, to_host=self.store.demote(index))
        # A subgroup that left without a path may have grown the cache by a buffer.
        self.store.cache.capacity = plan.capacity
        if not plan.device_sized:
            plan.device_sized = True
            start = ("" if plan.device_budget is None else
                     f", {before} before the first step from the plan's budget "
                     f"{gb(plan.device_budget)} GB")
            log.info("offload: rank %d device tier (auto): %d of %d subgroups, %s GB "
                     "(device memory %s GB, peak besides it %s GB, reserve %s GB%s)",
                     self.rank, len(plan.device_members), len(self.subgroups),
                     gb(plan.device_bytes()), gb(limit), gb(others), gb(reserve), start)
        elif leaving:
            log.warning("offload: rank %d device tier gives back %d subgroups (%s GB) to the "
                        "host: the peak grew to %s GB; it keeps %d (%s GB)", self.rank,
                        len(leaving), gb(sum(self.sizes[i] for i in leaving)), gb(peak),
                        len(plan.device_members), gb(plan.device_bytes()))

    # ----------------------------------------------------------------- initialization

    def _fill(self, sources: Callable[[int, torch.Tensor], None],
              before: Optional[Callable[[int], None]] = None,
              device_direct: bool = False) -> None:
        """Fills every subgroup's state, writing out what the cache cannot keep.

        The fill runs opposite to the next step's order, so that step starts on the
        subgroups that stayed in the cache. ``device_direct``: ``sources`` may write the
        device tier's states where they are (see :meth:`SubgroupStore.fill`).
        """
        slot = self.streamed.fill_slot() if device_direct else None
        self.store.fill(sources, self.fill_order(self.step_count), before=before,
                        device_direct=device_direct, device_slot=slot)
        self.initialized = True

    def fill_order(self, step: int) -> List[int]:
        """The order a fill at ``step`` writes the subgroups: opposite to the next step's."""
        return list(reversed(self.order(step + 1)))

    def subgroups_of(self, param: int, start: int, length: int) -> List[int]:
        """Subgroups holding elements ``[start, start + length)`` of shard parameter ``param``."""
        return [index for index, sg in enumerate(self.subgroups) for piece in sg.pieces
                if piece.param == param and piece.start < start + length
                and start < piece.start + piece.length]

    def release(self, index: int) -> None:
        """Frees subgroup ``index``'s host buffer for good.

        A replaced engine's subgroup after its last read (ZenFlow's re-selection). Its
        file, if any, stays until :meth:`close`; the engine must not read it again.
        """
        if index in self.store.cache:
            self.store.settle(index)
            self.write_back.wait_readers()
            self.store.cache.discard(self.store.cache.pop(index).buffer)

    def initialize_from_model(self) -> None:
        """fp32 masters from the model's current weights; zero moments.

        The device tier's states are built on the device from the weights there (at the
        device's memory speed: 80 GB of them took 98 s through a host buffer); with the
        streamed update's slot (on CUDA) so are the host subgroups', each then copied to
        its pinned buffer once; without it the host builds them.
        """
        def fill(param: int, start: int, length: int, views: List[torch.Tensor]) -> None:
            views[0].copy_(self.params[param].init().reshape(-1)[start:start + length])
            views[1].zero_()
            views[2].zero_()
        self.initialize_from(fill, device_direct=True)

    def initialize_from(self, fill: Callable[[int, int, int, List[torch.Tensor]], None],
                        step: int = 0, before: Optional[Callable[[int], None]] = None,
                        device_direct: bool = False) -> None:
        """Every state from ``fill(param, start, length, [master, exp_avg, exp_avg_sq])``.

        ``fill`` writes elements ``[start, start + length)`` of shard parameter ``param``
        into the three views (the master's fp32, the moments' in their dtypes); it is
        called piece by piece, a subgroup at a time, and what the cache cannot keep is
        written out as it goes. ``step``: the Adam steps the states have taken (their bias
        correction continues from it). With remainders the params' ``out`` become the bf16
        weights of the masters (the other half of each master).
        ``before(index)`` is called before subgroup ``index`` takes a buffer.
        ``device_direct``: ``fill`` is torch ops on tensors of any device, so the device
        tier's states are filled where they are (no host buffer, no PCIe) and, where the
        streamed update lends its slot, the host subgroups' there, each copied down once.
        """
        self.step_count = step
        self.store.version = [step] * len(self.subgroups)
        remainders = self.layout.remainders
        master = torch.empty(self.max_numel if remainders else 0, dtype=torch.float32)
        weights = torch.empty(self.max_numel if remainders else 0, dtype=self.model_dtype)

        def source(index: int, buffer: torch.Tensor) -> None:
            sg = self.subgroups[index]
            views = self._views(buffer, index)
            scratch = (master, weights)
            if remainders and buffer.device != master.device:
                scratch = self.on_device.master_scratches()
            into = [scratch[0][:sg.numel], *views[1:]] if remainders else views
            for piece in sg.pieces:
                fill(piece.param, piece.start, piece.length,
                     [view[piece.offset:piece.offset + piece.length] for view in into])
            if remainders:
                store_masters(self.layout, views, scratch[0][:sg.numel], scratch[1][:sg.numel])
                scatter(self.params, sg, scratch[1][:sg.numel])
        self._fill(source, before, device_direct=device_direct)

    def full_states(self, index: int) -> List[torch.Tensor]:
        """Subgroup ``index``'s [master, exp_avg, exp_avg_sq] as the math sees them (copies).

        The master in fp32 (rebuilt from the remainders and the weights where they are
        used), the moments in their dtypes without the bit remainders keep in exp_avg_sq.
        """
        sg = self.subgroups[index]
        buffer = self._acquire_sync(index)
        views = self._views(buffer, index)
        outs = [torch.empty(sg.numel, dtype=torch.float32),
                torch.empty_like(views[1], device="cpu"), torch.empty_like(views[2], device="cpu")]
        params = self._weights_of(index, buffer.device) if self.layout.remainders else None
        read_masters(self.layout, views, 0, sg.numel, params, outs)
        return outs

    def _weights_of(self, index: int, device: torch.device) -> torch.Tensor:
        """Subgroup ``index``'s current weights (from the params' ``out``) on ``device``."""
        sg = self.subgroups[index]
        return gather_params(self.params, sg, torch.empty(sg.numel, dtype=self.model_dtype,
                                                          device=device))

    def read_states(self, param: int, start: int, length: int,
                    outs: Sequence[torch.Tensor]) -> None:
        """Copies some of one shard parameter's states into ``outs``.

        Elements ``[start, start + length)`` of parameter ``param``'s master, exp_avg and
        exp_avg_sq go into the three tensors ``outs``; subgroups are fetched as needed. The
        masters are whole fp32 (rebuilt from their remainders and the weights where those
        are stored): what a checkpoint of Megatron-LM's format holds.
        """
        if self._param_pieces is None:
            self._param_pieces = {}
            for index, sg in enumerate(self.subgroups):
                for piece in sg.pieces:
                    self._param_pieces.setdefault(piece.param, []).append((index, piece))
        for index, piece in self._param_pieces.get(param, ()):
            lo, hi = max(start, piece.start), min(start + length, piece.start + piece.length)
            if lo >= hi:
                continue
            buffer = self._acquire_sync(index)
            views = self._views(buffer, index)
            at = piece.offset + lo - piece.start
            weights = (self.params[param].out[lo:hi] if self.layout.remainders else None)
            read_masters(self.layout, views, at, hi - lo, weights,
                         [out[lo - start:hi - start] for out in outs])

    def reset_masters_from_model(self) -> None:
        """Rebuilds the fp32 masters from the model's weights, keeping the moments.

        With remainders: zero remainders and ``up`` bits, and the weights written into the
        params' ``out`` (the same values where those are the model's weights).
        """
        if not self.initialized:
            return
        for index, sg in enumerate(self.subgroups):
            buffer = self._acquire_sync(index)
            views = self._views(buffer, index)
            master = (torch.empty(sg.numel, dtype=torch.float32, device=buffer.device)
                      if self.layout.remainders else views[0])
            for piece in sg.pieces:
                src = self.params[piece.param].init().reshape(-1)
                master[piece.offset:piece.offset + piece.length].copy_(
                    src[piece.start:piece.start + piece.length])
            if self.layout.remainders:
                weights = torch.empty(sg.numel, dtype=self.model_dtype, device=buffer.device)
                store_masters(self.layout, views, master, weights)
                scatter(self.params, sg, weights)
            if not self.tier_plan.on_device(index):
                self.cache.get(index).dirty = True
        self.wait_io()

    # ----------------------------------------------------------------- the step

    def step(self, hparams: Sequence[dict], inv_scale: Optional[torch.Tensor],
             clip_coeff: Optional[float]) -> None:
        """One optimizer step over all subgroups.

        Args:
            hparams: the optimizer's param groups (lr, betas, eps, weight_decay), by index.
            inv_scale: fp16 loss-scale inverse to unscale the gradients with, or None.
            clip_coeff: the gradient-clipping factor (< 1) or None.
        """
        # ``auto``: the first step sizes the device tier before the states exist (the
        # forward and backward of this iteration are the peak it measures).
        self._size_device_tier()
        if not self.initialized:
            self.initialize_from_model()
        self.tier_plan.rates.observe(*self.cpu.take_counts(), *self.streamed.take_counts())
        self.step_count += 1
        self.store.start_step()
        # Plan: who updates each subgroup, in this step's order.
        order = self.order(self.step_count)
        plan = self.plan(order)
        host_order = [i for i in order if plan[i] is not Updater.DEVICE]
        args = StepArgs(self.step_count, hparams, inv_scale, clip_coeff)
        self.cpu.begin([i for i in order if plan[i] is Updater.CPU], args)
        args.device_inv_scale = self.on_device.scale(inv_scale)
        capacity = self.tier_plan.capacity
        depth = 1 if capacity is None else max(1, min(2, capacity - len(self.resident) - 2))
        pending: Dict[int, Future] = {}
        position = {index: k for k, index in enumerate(host_order)}
        for index in order:
            entry = None
            if plan[index] is Updater.DEVICE:
                buffer = self.store.device_state(index)
            else:
                # Prefetch the next ones, then wait for this one (the stall).
                k = position[index]
                ahead = host_order[k + 1:k + 1 + depth]
                for nxt in ahead:
                    if nxt not in self.cache and nxt not in pending:
                        pending[nxt] = self.store.start_fetch(
                            nxt, protect=[index, *ahead, *pending])
                entry = self.store.entry(index, pending)
                buffer = entry.buffer
            # Update and write back.
            self.updaters[plan[index]].update(index, buffer, args)
            self.store.version[index] = self.step_count
            if entry is not None:
                entry.dirty = True
        self.cpu.end()
        # Rebalance: subgroups follow the paths' observed throughputs.
        for index, source, target in self.tier_plan.rebalance(self.store.bad_paths):
            log.info("offload: rank %d moves subgroup %d from %s to %s (observed "
                     "throughput)", self.rank, index, self.tiers[source].path,
                     self.tiers[target].path)
        self.stats.steps += 1

    def write_all_params(self) -> None:
        """Copies every fp32 master into the model (used after a load).

        With remainders there is nothing to copy: the weights are the masters' top halves.
        """
        if self.layout.remainders:
            return
        for index in range(len(self.subgroups)):
            master = self._views(self._acquire_sync(index), index)[0]
            if self.tier_plan.on_device(index):
                scatter(self.params, self.subgroups[index], master)
                continue
            self.write_back(index, master, 0)
            self.write_back.sync()
        self.wait_io()

    # ----------------------------------------------------------------- checkpoints

    def save(self, directory: str, extra: dict) -> None:
        """Puts this rank's state files under ``directory`` with a manifest (see checkpoint)."""
        if not self.initialized:
            self.initialize_from_model()
        self.wait_io()
        checkpoint.save(self.store, directory,
                        checkpoint.engine_fields(self.step_count, self.fingerprint, self.cfg,
                                                 self.layout), extra)

    def load(self, directory: str, expect: dict) -> None:
        """Restores this rank's state from a checkpoint's offload directory.

        States saved with the masters stored the other way (whole or as remainders:
        ``--no-store-param-remainders``) are converted as they are read.
        """
        manifest, read = checkpoint.open_rank(directory, self.rank, expect,
                                              fingerprint=self.fingerprint,
                                              layout=self.layout, cfg=self.cfg)
        saved = checkpoint.saved_layout(manifest, self.layout)
        self.wait_io()
        self.store.drop_cached()
        self.step_count = manifest["step"]
        self.store.forget_files(self.step_count)
        if saved == self.layout:
            self._fill(lambda index, buffer: read(self.store, index, buffer))
            return
        staging = aligned_empty(saved.nbytes(self.max_numel))

        def source(index: int, buffer: torch.Tensor) -> None:
            sg = self.subgroups[index]
            read(self.store, index, staging, saved)
            weights = self._weights_of(index, torch.device("cpu"))
            needed = convert(saved, saved.views(staging, sg.numel), self.layout,
                             self._views(buffer, index), weights)
            if needed is None:
                return
            if not self.params_are_model:
                scatter(self.params, sg, needed)
            elif not torch.equal(needed.view(torch.int16), weights.view(torch.int16)):
                raise UsageError(
                    f"{directory}: its optimizer states hold whole fp32 masters whose bf16 "
                    "rounding is not the loaded model's weights, so they cannot be stored as "
                    "remainders: resume with --no-store-param-remainders")
        self._fill(source)

    # ----------------------------------------------------------------- metrics, shutdown

    def metrics(self) -> Dict[str, float]:
        """Per-iteration averages since the last call (then reset): :mod:`.engine_metrics`."""
        return self._metrics.collect(self)

    def close(self, remove_files: bool = True) -> None:
        """Stops the threads and removes this rank's tier files."""
        self.store.close(remove_files)
