"""Where ZenFlow's CPU side keeps its fp32 masters and Adam moments: one interface, two places.

The CPU side's states are, per param group, one compact vector of the delayed columns (in
the CPU plan's order, ``selection.Plan``). :class:`CpuStates` is what the CPU worker and
the engine ask of them: a window's Adam step, the masters cast into the upload buffers,
reads and a refill, the move of a re-selection (each picks its way of :mod:`.moves`),
checkpoints. :class:`HostCpuStates` keeps them in host memory (``--zenflow-cpu-states
host``); :class:`TieredCpuStates` in an offload engine, whose host cache and
``--offload-paths`` files hold them (``tiers``). Both give the same states bit for bit
after the same updates (and moves).
"""

from __future__ import annotations

import abc
from typing import Callable, Dict, List, Optional

import torch

from megatron_ext.errors import UsageError
from megatron_ext.optim.adamw import adam_update
from megatron_ext.zenflow.kept_weights import KeptWeights, keep_for
from megatron_ext.zenflow.moves import KINDS, Fill, Move

Renew = Callable[[Dict[int, int]], Dict[int, torch.Tensor]]
"""``renew(sizes)``: the CPU worker's fresh accumulators and upload buffers of the new
per-group ``sizes``; returns the upload buffers (the new weights go there from then on)."""


class CpuStates(abc.ABC):
    """The CPU side's fp32 master and Adam moments per param group (delayed columns).

    The new weights of an update and of :meth:`write_upload` go, in the model's dtype,
    into the upload buffers given with the sizes (:meth:`resize`, :meth:`replace`); the
    CPU worker owns those, and guards them, before it calls either.
    """

    steps: int = 0
    """Adam steps taken (the CPU side's bias correction counts these)."""

    @abc.abstractmethod
    def resize(self, sizes: Dict[int, int], upload: Dict[int, torch.Tensor]) -> None:
        """Fresh states for the per-group ``sizes``; new weights go into ``upload``.

        Zero moments; the masters come from :meth:`set_masters` next.
        """

    @abc.abstractmethod
    def set_masters(self, masters: Dict[int, torch.Tensor]) -> None:
        """fp32 masters per group from these weights (the model's); moments kept."""

    @abc.abstractmethod
    def update(self, grads: Dict[int, torch.Tensor], hparams: List[dict]) -> None:
        """One Adam step with a window's mean fp32 ``grads`` per group.

        The new weights go into the upload buffers.
        """

    @abc.abstractmethod
    def write_upload(self) -> None:
        """The masters, cast to the model's dtype, into the upload buffers."""

    @abc.abstractmethod
    def read(self, group: int, start: int, length: int, outs: List[torch.Tensor]) -> None:
        """Some of one group's states (fp32, in its compact order) into ``outs``.

        Elements ``[start, start + length)`` of ``group``'s master, exp_avg and exp_avg_sq
        go into the three tensors; during :meth:`replace`, the replaced states'.
        """

    @abc.abstractmethod
    def replace(self, sizes: Dict[int, int], upload: Dict[int, torch.Tensor],
                fill: Fill) -> None:
        """New states for the new per-group ``sizes`` (a re-selection); the old ones go.

        ``fill`` writes them and may :meth:`read` the old ones. The step count carries
        over; new weights go into ``upload`` from now on.
        """

    @abc.abstractmethod
    def move(self, move: Move, renew: Renew) -> Dict[str, Dict[int, torch.Tensor]]:
        """A re-selection's move (:class:`~.moves.Move`) the way these states are best moved.

        Every element of the GPU side's states and of these goes to its side under the
        new plans; returns the GPU side's new states. ``renew`` is called once, with the
        new CPU sizes, before the new states take the upload buffers it returns. The step
        count carries over.
        """

    @abc.abstractmethod
    def state_dict(self) -> Dict[str, Dict[int, torch.Tensor]]:
        """The states a checkpoint's rank file holds (kind -> group -> tensor), if any."""

    @abc.abstractmethod
    def load_state_dict(self, saved: Dict[str, Dict[int, torch.Tensor]]) -> None:
        """Restores :meth:`state_dict` into states of the saved sizes (after :meth:`resize`)."""

    @abc.abstractmethod
    def save(self, directory: str, layout) -> None:
        """Writes the states that live outside the rank file into ``directory``, if any."""

    @abc.abstractmethod
    def load(self, directory: str, layout) -> None:
        """Restores :meth:`save` (after :meth:`load_state_dict`)."""

    @abc.abstractmethod
    def metrics(self) -> Dict[str, float]:
        """Metrics of the state store since the last call."""

    @abc.abstractmethod
    def host_bytes(self) -> int:
        """Host memory the states hold."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases the states (and any files of theirs)."""


class HostCpuStates(CpuStates):
    """The states in host memory.

    Adam is the one-pass host AdamW with ``fused`` (GPU machines: the same bits as the
    tiers' engines, however the states are cut), else the reference implementation (bit
    for bit megatron-core's on a CPU).
    """

    def __init__(self, fused: bool = False):
        self.fused = fused
        self.steps = 0
        self.master: Dict[int, torch.Tensor] = {}
        self.exp_avg: Dict[int, torch.Tensor] = {}
        self.exp_avg_sq: Dict[int, torch.Tensor] = {}
        self._upload: Dict[int, torch.Tensor] = {}

    def _stores(self) -> List[Dict[int, torch.Tensor]]:
        return [self.master, self.exp_avg, self.exp_avg_sq]

    def resize(self, sizes: Dict[int, int], upload: Dict[int, torch.Tensor]) -> None:
        """Zero states of the per-group ``sizes``."""
        for store in self._stores():
            store.clear()
            store.update({g: torch.zeros(n, dtype=torch.float32) for g, n in sizes.items()})
        self._upload = upload

    def set_masters(self, masters: Dict[int, torch.Tensor]) -> None:
        """Copies (and casts) ``masters`` into the fp32 masters."""
        for group, values in masters.items():
            self.master[group].copy_(values)

    def update(self, grads: Dict[int, torch.Tensor], hparams: List[dict]) -> None:
        """Adam per group in place, then the masters into the upload buffers."""
        self.steps += 1
        for group in self.master:
            adam_update(self.master[group], grads[group], self.exp_avg[group],
                        self.exp_avg_sq[group], self.steps, hparams[group], fused=self.fused)
            self._upload[group].copy_(self.master[group])

    def write_upload(self) -> None:
        """Casts the masters into the upload buffers."""
        for group, master in self.master.items():
            self._upload[group].copy_(master)

    def read(self, group: int, start: int, length: int, outs: List[torch.Tensor]) -> None:
        """Copies of the three states' elements."""
        for store, out in zip(self._stores(), outs):
            out.copy_(store[group][start:start + length])

    def replace(self, sizes: Dict[int, int], upload: Dict[int, torch.Tensor],
                fill: Fill) -> None:
        """New tensors filled group by group; the old ones are dropped after all are."""
        new = [{} for _ in KINDS]
        for group, n in sizes.items():
            views = [torch.empty(n, dtype=torch.float32) for _ in KINDS]
            fill(group, 0, n, views)
            for store, view in zip(new, views):
                store[group] = view
        for store, values in zip(self._stores(), new):
            store.clear()
            store.update(values)
        self._upload = upload

    def move(self, move: Move, renew: Renew) -> Dict[str, Dict[int, torch.Tensor]]:
        """Whole groups, one kind at a time (:meth:`~.moves.Move.whole_groups`).

        Each old kind is dropped before the next kind moves: the host holds the old
        states and about one kind more (a segment move would hold old and new whole).
        """
        gpu, new = move.whole_groups(dict(zip(KINDS, self._stores())))
        for store, kind in zip(self._stores(), KINDS):
            store.clear()
            store.update(new[kind])
        # The worker's new buffers only once the states have moved (the old accumulators
        # go then): the order, and so the host memory peak, the host move always had.
        self._upload = renew(dict(move.new_cpu.sizes))
        return gpu

    def state_dict(self) -> Dict[str, Dict[int, torch.Tensor]]:
        """master, exp_avg and exp_avg_sq per group (the tensors themselves)."""
        return {kind: dict(store) for kind, store in zip(KINDS, self._stores())}

    def load_state_dict(self, saved: Dict[str, Dict[int, torch.Tensor]]) -> None:
        """Copies the saved states in; refuses a state without them (saved by the tiers)."""
        if self.master and not saved.get("master"):
            # Also a run without --offload-optimizer whose memory plan moved the states to
            # the offload engine's host cache (auto), resumed where host memory has room.
            raise UsageError("the ZenFlow state holds no CPU-side states: it was saved with "
                             "--zenflow-cpu-states tiers (in the offload engine, given by "
                             "--offload-optimizer or chosen by auto where host memory was "
                             "short); resume with --offload-optimizer (and the "
                             "--offload-subgroup-size it was saved with)")
        for kind, store in zip(KINDS, self._stores()):
            for group, tensor in saved.get(kind, {}).items():
                store[group].copy_(tensor)

    def save(self, directory: str, layout) -> None:
        """Nothing: the rank file holds the states (:meth:`state_dict`)."""

    def load(self, directory: str, layout) -> None:
        """Nothing: :meth:`load_state_dict` restored them."""

    def metrics(self) -> Dict[str, float]:
        """None in host memory."""
        return {}

    def host_bytes(self) -> int:
        """The three states' bytes."""
        return sum(t.numel() * t.element_size() for s in self._stores() for t in s.values())

    def close(self) -> None:
        """Nothing to release but memory."""


class TieredCpuStates(CpuStates):
    """The states in offload engines: their host cache and files on ``--offload-paths``.

    One "parameter" of the engine per param group (the group's compact delayed columns):
    a window's update is one engine step over all its subgroups, with the window's mean
    gradients as the gradients and the upload buffers as the model weights it writes.
    Re-selection fills a new engine (its files in a directory of their own) from the GPU
    side's states and the old engine's, then closes the old one and removes its files.

    The engine's layout comes with it: with bf16 weights its masters are 16-bit remainders
    beside the upload buffers (``--no-store-param-remainders`` turns it off), which then
    always hold the masters' bf16 weights (every update and fill writes them); a checkpoint
    keeps them in the rank file (:meth:`state_dict`), 2 bytes per delayed element.
    """

    def __init__(self, make_engine: Callable):
        self._make_engine = make_engine
        """``make_engine(params, generation)``: an offload engine whose files do not collide
        with those of another generation (re-selection fills a new engine from the old)."""
        self.engine = None
        self.steps = 0
        self.sizes: Dict[int, int] = {}
        self.generation = 0
        self._source = None
        """(engine, its groups) that :meth:`read` reads while :meth:`replace` fills a new
        engine."""
        self._kept: Optional[KeptWeights] = None
        """During :meth:`replace`: the replaced engine's weights that the new engine's fill
        wrote over (its ``out`` and the new one's share memory: :mod:`.kept_weights`)."""
        self._grads: Dict[int, torch.Tensor] = {}
        self._init: Dict[int, torch.Tensor] = {}
        self._upload: Dict[int, torch.Tensor] = {}

    def _new_engine(self, sizes: Dict[int, int], upload: Dict[int, torch.Tensor]):
        from megatron_ext.offload.subgroups import ShardParam

        params = [ShardParam(numel=n, group=g, grad=lambda g=g: self._grads[g],
                             out=upload[g], init=lambda g=g: self._init[g])
                  for g, n in sorted(sizes.items())]
        self._upload = upload
        return self._make_engine(params, self.generation)

    def resize(self, sizes: Dict[int, int], upload: Dict[int, torch.Tensor]) -> None:
        """A fresh engine for the per-group sizes (the old one closed)."""
        self.sizes = dict(sizes)
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if sizes:
            self.engine = self._new_engine(sizes, upload)

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

    def update(self, grads: Dict[int, torch.Tensor], hparams: List[dict]) -> None:
        """One engine step over every subgroup."""
        if self.engine is not None:
            self._grads = grads
            self.engine.step(hparams, None, None)
        self.steps += 1

    def write_upload(self) -> None:
        """The engine's masters, cast, into the upload buffers."""
        if self.engine is not None:
            self.engine.write_all_params()

    def read(self, group: int, start: int, length: int, outs: List[torch.Tensor]) -> None:
        """From the engine (the replaced one during :meth:`replace`)."""
        engine, groups = self._source or (self.engine, sorted(self.sizes))
        param = groups.index(group)
        if self._source is not None and self._kept is not None:
            # The replaced engine's weights where the new one has written its own.
            with self._kept.reading(param, start, length):
                engine.read_states(param, start, length, outs)
            return
        engine.read_states(param, start, length, outs)

    def replace(self, sizes: Dict[int, int], upload: Dict[int, torch.Tensor],
                fill: Fill) -> None:
        """A new engine for the new per-group ``sizes``; then the old one and its files go.

        Both engines' files are on the paths while the states move (each engine under its
        own directory); the Adam step count carries over.
        """
        self._replace(sizes, upload, fill)

    def _replace(self, sizes: Dict[int, int], upload: Dict[int, torch.Tensor], fill: Fill,
                 reads: Optional[Callable] = None) -> None:
        """:meth:`replace`, freeing the old engine's host buffers after their last read.

        ``reads(group, start, length)``: the old states' ranges that ``fill`` reads for
        those new elements (``Move.old_cpu_reads``); None: the old engine is kept whole
        until the new one is filled.
        """
        old = self.engine
        old_groups = sorted(self.sizes)
        self._source = (old, old_groups) if old is not None else None
        self.generation += 1
        self.sizes = dict(sizes)
        groups = sorted(sizes)
        try:
            if sizes:
                self.engine = self._new_engine(sizes, upload)
                step = old.step_count if old is not None else 0
                self._kept = keep_for(old, self.engine)
                release = (_releasing(self.engine, step, groups, old, old_groups, reads,
                                      self._kept)
                           if old is not None and reads is not None else None)
                self.engine.initialize_from(
                    lambda param, start, length, views: fill(groups[param], start, length,
                                                             views), step=step,
                    before=_before_fill(self.engine, release, self._kept))
            else:
                self.engine = None
        finally:
            self._source = None
            self._kept = None
        if old is not None:
            old.close()

    def move(self, move: Move, renew: Renew) -> Dict[str, Dict[int, torch.Tensor]]:
        """Segment by segment (:meth:`~.moves.Move.segments`) into a new engine.

        Nothing of the states' size enters host memory beside the old and the new
        engine's buffers, and of the old engine's only those a later fill still reads:
        each is freed after its last read (with every subgroup in the host cache, the
        move holds about one copy of the states, not two).
        """
        return move.segments(self.read, lambda sizes, fill: self._replace(
            sizes, renew(sizes), fill, reads=move.old_cpu_reads))

    def state_dict(self) -> Dict[str, Dict[int, torch.Tensor]]:
        """What the rank file holds: with remainders, the bf16 weights beside them.

        The states themselves are not there: the engine saves its files with the
        checkpoint.
        """
        if self.engine is None or not self.engine.layout.remainders:
            return {}
        return {"params": {g: t.clone() for g, t in self._upload.items()}}

    def load_state_dict(self, saved: Dict[str, Dict[int, torch.Tensor]]) -> None:
        """The weights beside remainders, if saved.

        Refuses a state that holds the states (saved in host memory).
        """
        if any(saved.get(kind) for kind in KINDS):
            raise UsageError("the ZenFlow state holds the CPU side's states: it was saved with "
                             "--zenflow-cpu-states host (in host memory); resume with "
                             "--zenflow-cpu-states host")
        for group, tensor in saved.get("params", {}).items():
            self._upload[group].copy_(tensor)

    def save(self, directory: str, layout) -> None:
        """The engine's states into ``directory`` (no engine: no delayed columns)."""
        if self.engine is not None:
            self.engine.save(directory, layout)

    def load(self, directory: str, layout) -> None:
        """The engine's states from ``directory``."""
        if self.engine is not None:
            self.engine.load(directory, layout)

    def metrics(self) -> Dict[str, float]:
        """The engine's ``offload/*`` metrics since the last call."""
        return self.engine.metrics() if self.engine is not None else {}

    def host_bytes(self) -> int:
        """The engine's host cache."""
        if self.engine is None:
            return 0
        return len(self.engine.cache) * self.engine.buffer_bytes

    def close(self) -> None:
        """Stops the engine (its tier files are removed)."""
        if self.engine is not None:
            self.engine.close()


def _before_fill(new, release: Optional[Callable[[int], None]],
                 kept: Optional[KeptWeights]) -> Optional[Callable[[int], None]]:
    """The new engine's fill's ``before(index)``: releases, then keeps old weights.

    The old subgroups no later fill reads are released (``release``), then the old weights
    that new subgroup ``index``'s write covers are kept (:class:`~.kept_weights.KeptWeights`).
    """
    if kept is None:
        return release

    def before(index: int) -> None:
        if release is not None:
            release(index)
        kept.save(new.subgroups[index].pieces)
    return before


def _releasing(new, step: int, groups: List[int], old, old_groups: List[int],
               reads: Callable, kept: Optional[KeptWeights] = None) -> Callable[[int], None]:
    """The new engine's fill's ``before(index)``: frees old subgroups no later fill reads.

    The new engine fills its subgroups in a known order (``fill_order``); ``reads`` says
    which old elements each of its pieces' fill reads. Before a new subgroup takes its
    buffer, every old subgroup whose last reader came earlier is released
    (:meth:`OffloadEngine.release`); one no fill reads (all of it moved to the GPU
    side), before the first.
    """
    position = {index: k for k, index in enumerate(new.fill_order(step))}
    last = {index: -1 for index in range(len(old.subgroups))}
    for index, sg in enumerate(new.subgroups):
        for piece in sg.pieces:
            # The old pieces a new piece reads lie together (both sides' buffers follow
            # the model's order): one covering range per old group.
            spans: Dict[int, List[int]] = {}
            for group, start, length in reads(groups[piece.param], piece.start, piece.length):
                span = spans.setdefault(group, [start, start + length])
                span[0], span[1] = min(span[0], start), max(span[1], start + length)
            for group, (lo, hi) in spans.items():
                for old_index in old.subgroups_of(old_groups.index(group), lo, hi - lo):
                    last[old_index] = max(last[old_index], position[index])
    by_place: Dict[int, List[int]] = {}
    for old_index, k in last.items():
        by_place.setdefault(k, []).append(old_index)
    done = [-2]

    def before(index: int) -> None:
        while done[0] < position[index] - 1:
            done[0] += 1
            for old_index in by_place.get(done[0], ()):
                old.release(old_index)
                if kept is not None:
                    kept.release(old_index)
    return before


def offload_engines(offload_config, run_id: str, tiers, *, rank: int,
                    model_dtype: torch.dtype, fused_adam: bool) -> Callable:
    """``make_engine(params, generation)`` for :class:`TieredCpuStates` on a run's tiers.

    ``offload_config``, ``run_id`` and ``tiers`` as ``offload.optimizer.offload_setup``
    gives them; ``fused_adam``: the one-pass host AdamW (on GPU machines; a CPU-only run
    takes the reference implementation).
    """
    def make_engine(params, generation=0):
        from megatron_ext.offload.engine import OffloadEngine

        # Each re-selection's engine in its own directory: the next one is filled from the
        # previous one's files.
        engine = OffloadEngine(offload_config, params, rank=rank, device=torch.device("cpu"),
                               tiers=tiers, run_id=run_id if not generation else
                               f"{run_id}.selection{generation}",
                               model_dtype=model_dtype, grad_dtype=torch.float32,
                               params_are_model=False)
        engine.fused_adam = fused_adam
        return engine
    return make_engine
