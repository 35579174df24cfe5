"""ZenFlow's engine against a plain-PyTorch reference of its semantics, bit for bit.

The reference keeps every state as a whole tensor per parameter and marks the selected
columns with boolean masks; it runs Adam (torch's functional implementation, like the
engine) on the masked elements. It therefore never "moves" a state: if the engine lost,
duplicated or misplaced a moment when columns change sides, or applied a CPU update to
the wrong window, its states and weights would differ from the reference's.

The semantics written out here: the GPU side (selected columns, 1-D parameters) takes an
Adam step every iteration with its own step count; the CPU side accumulates the other
columns' gradients (unscaled, clipped, fp32) and at a window's end takes one Adam step with
their mean and its own count; the result enters the model at the end of the next window
(at once for synchronous warm-up steps and when a re-selection follows). Columns are
selected by gradient energy at step 1 and re-selected at window ends.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch
from torch.optim.adam import adam

from megatron_ext.errors import UsageError
from megatron_ext.optim.sharded_optimizer import Shard
from megatron_ext.runtime import host_kernels
from megatron_ext.zenflow import cpu_affinity, cpu_worker
from megatron_ext.zenflow.config import ZenFlowConfig
from megatron_ext.zenflow.cpu_states import TieredCpuStates
from megatron_ext.zenflow.engine import ZenFlowEngine
from megatron_ext.zenflow.moves import KINDS
from megatron_ext.zenflow.selection import top_columns

# (shape, param group, owned range as fractions of the flattened parameter)
PARAMS = [((6, 10), 0, (0.15, 0.9)), ((13,), 1, (0.0, 1.0)), ((9, 7), 1, (0.3, 1.0)),
          ((5,), 0, (0.2, 0.8)), ((4, 16), 0, (0.05, 0.55))]
HPARAMS = [{"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
           {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0}]


def make_shards(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shards = []
    for shape, group, (lo, hi) in PARAMS:
        param = torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype),
                                   requires_grad=False)
        param.main_grad = torch.zeros(shape, dtype=dtype)
        n = param.numel()
        shards.append(Shard(model_param=param, group=group, start=int(lo * n), end=int(hi * n),
                            counts_in_norm=True))
    return shards


def grads_for(step, dtype):
    """Deterministic gradients of a step (full parameters)."""
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for shape, _, _ in PARAMS:
        g = torch.randn(shape, generator=gen)
        if len(shape) == 2:  # some columns much more important than others
            g = g * torch.linspace(0.2, 3.0, shape[1])[torch.randperm(shape[1], generator=gen)]
        out.append(g.to(dtype))
    return out


def clip_for(step):
    return 0.5 if step % 5 == 0 else None


class Reference:
    """ZenFlow over whole tensors with masks."""

    def __init__(self, shards, cfg: ZenFlowConfig):
        self.cfg = cfg
        self.shards = shards
        self.weights = [s.weights().clone() for s in shards]
        self.master = [w.to(torch.float32, copy=True) for w in self.weights]
        self.exp_avg = [torch.zeros_like(m) for m in self.master]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.master]
        self.acc = [[torch.zeros_like(m) for m in self.master] for _ in range(2)]
        self.acc_n = [0, 0]
        self.on_gpu = None
        self.gpu_steps = self.cpu_steps = 0
        self.step_no = self.in_window = self.windows = 0
        self.last_select = 0
        self.pending = False

    def _select(self, grads):
        masks = []
        for shard, g in zip(self.shards, grads):
            param = shard.model_param
            if param.dim() != 2:
                masks.append(torch.ones(shard.numel, dtype=torch.bool))
                continue
            rows, cols = param.shape
            full = torch.zeros(rows * cols)
            full[shard.start:shard.end] = g.float()
            energy = full.view(rows, cols).double().square().sum(0)
            chosen = torch.zeros(cols, dtype=torch.bool)
            chosen[top_columns(energy, self.cfg.zenflow_topk_ratio)] = True
            col_of = torch.arange(shard.start, shard.end) % cols
            masks.append(chosen[col_of])
        self.on_gpu = masks

    def _adam(self, i, mask, grad, step, hp):
        if not mask.any():
            return
        master, m, v = (t[mask] for t in (self.master[i], self.exp_avg[i], self.exp_avg_sq[i]))
        beta1, beta2 = hp["betas"]
        adam([master], [grad[mask]], [m], [v], [], [torch.tensor(float(step - 1))],
             foreach=False, fused=None, capturable=False, differentiable=False,
             has_complex=False, amsgrad=False, beta1=beta1, beta2=beta2, lr=hp["lr"],
             weight_decay=hp["weight_decay"], eps=hp["eps"], maximize=False,
             decoupled_weight_decay=True)
        self.master[i][mask], self.exp_avg[i][mask], self.exp_avg_sq[i][mask] = master, m, v

    def _cpu_update(self, buffer):
        self.cpu_steps += 1
        n = self.acc_n[buffer]
        for i, shard in enumerate(self.shards):
            grad = self.acc[buffer][i]
            if n > 1:
                grad = grad / n
            self._adam(i, ~self.on_gpu[i], grad, self.cpu_steps, HPARAMS[shard.group])
            self.acc[buffer][i].zero_()
        self.acc_n[buffer] = 0

    def _apply_cpu_side(self):
        for i in range(len(self.shards)):
            mask = ~self.on_gpu[i]
            self.weights[i][mask] = self.master[i][mask].to(self.weights[i].dtype)

    def step(self, grads, clip):
        cfg = self.cfg
        self.step_no += 1
        sync = self.step_no <= cfg.zenflow_full_warmup_steps
        closes = False
        if not sync:
            self.in_window += 1
            closes = self.in_window >= cfg.fixed_interval
        if self.on_gpu is None:
            self._select(grads)
            self.last_select = 1
            select = False
        else:
            select = (self.step_no - self.last_select >= cfg.zenflow_select_interval
                      and (sync or closes))
            if select:
                self.last_select = self.step_no
        fp32 = []
        for g in grads:
            g = g.float()
            if clip is not None:
                g = g * clip
            fp32.append(g)
        self.gpu_steps += 1
        for i, shard in enumerate(self.shards):
            mask = self.on_gpu[i]
            self._adam(i, mask, fp32[i], self.gpu_steps, HPARAMS[shard.group])
            self.weights[i][mask] = self.master[i][mask].to(self.weights[i].dtype)
        buffer = self.windows % 2
        for i in range(len(self.shards)):
            self.acc[buffer][i][~self.on_gpu[i]] += fp32[i][~self.on_gpu[i]]
        self.acc_n[buffer] += 1
        if sync:
            self._cpu_update(buffer)
            self._apply_cpu_side()
        elif closes:
            if self.pending:
                self._apply_cpu_side()
            self._cpu_update(buffer)
            self.pending = True
            if select:
                self._apply_cpu_side()
                self.pending = False
            self.windows += 1
            self.in_window = 0
        if select:
            self._select(grads)


def engine_state(engine, shards):
    """The engine's states as whole per-shard tensors (scattered from both sides)."""
    full = {k: [torch.full((s.numel,), float("nan")) for s in shards] for k in KINDS}
    for kind in KINDS:
        for group in engine.gpu_plan.sizes:
            engine.gpu_plan.scatter(group, engine.gpu[kind][group], full[kind].__getitem__)
        for group, n in engine.cpu_plan.sizes.items():
            # Through the CPU side's interface: in host memory or in the engine's files.
            parts = [torch.empty(n) for _ in KINDS]
            engine.states.read(group, 0, n, parts)
            values = parts[KINDS.index(kind)]
            engine.cpu_plan.scatter(group, values, full[kind].__getitem__)
    return full


def tiered_engine_factory(tmp_path, dtype, made: list):
    """make_engine for TieredCpuStates: offload engines on two tier directories, small
    subgroups (they cut through groups, pieces and columns), a cache of three of them."""
    from megatron_ext.offload.config import OffloadConfig
    from megatron_ext.offload.engine import OffloadEngine
    from megatron_ext.offload.paths import TierSpec

    tiers = []
    for i in range(2):
        (tmp_path / f"tier{i}").mkdir(exist_ok=True)
        tiers.append(TierSpec(str(tmp_path / f"tier{i}"), read_gbps=2.0 - i, write_gbps=1.0))
    cfg = OffloadConfig(offload_optimizer=True, offload_paths=[t.path for t in tiers],
                        offload_subgroup_size=7, offload_host_cache_gb=3 * 7 * 12 / 1e9)

    def make(params, generation=0):
        engine = OffloadEngine(cfg, params, rank=0, device=torch.device("cpu"), tiers=tiers,
                               run_id=f"test.selection{generation}", model_dtype=dtype,
                               grad_dtype=torch.float32)
        made.append(engine)
        return engine
    return make


def run_both(cfg, dtype, steps, monkeypatch=None, jitter=None, make_cpu_engine=None,
             keep_open=False, place="host"):
    """The engine and the reference over ``steps`` steps; ``place``: the accumulation's.

    ``make_cpu_engine``: the CPU side's states in offload engines it makes (else in host
    memory); ``jitter``: the test knob (MEGATRON_EXT_ZENFLOW_JITTER) of random delays.
    """
    cfg = dataclasses.replace(cfg, zenflow_accumulate=place)
    if jitter is not None:  # the knob the variable sets, given to this run's config
        monkeypatch.setenv("MEGATRON_EXT_ZENFLOW_JITTER", str(jitter))
        cfg = dataclasses.replace(cfg, zenflow_jitter=ZenFlowConfig().zenflow_jitter)
    shards = make_shards(dtype)
    ref = Reference(make_shards(dtype), cfg)
    engine = ZenFlowEngine(cfg, shards, device=torch.device("cpu"), model_dtype=dtype,
                           grad_dtype=dtype, cpu_states=TieredCpuStates(make_cpu_engine)
                           if make_cpu_engine is not None else None)
    engine.cpu.trace = []
    expected_windows = []
    open_window = []
    try:
        for step in range(1, steps + 1):
            grads = grads_for(step, dtype)
            for shard, g in zip(shards, grads):
                shard.model_param.main_grad.view(-1)[shard.start:shard.end] = \
                    g.view(-1)[shard.start:shard.end]
            clip = clip_for(step)
            if engine.initialized:  # what this step sends to the CPU, in the plan in force
                open_window.append({grp: engine.cpu_plan.gather(
                    grp, lambda i: shards[i].grad().reshape(-1), torch.empty(n, dtype=dtype)
                ).float() * (clip if clip is not None else 1.0)
                    for grp, n in engine.cpu_plan.sizes.items()})
            closes_before = engine.schedule.windows_closed
            engine.step(HPARAMS, None, clip)
            ref.step([g.view(-1)[s.start:s.end] for s, g in zip(shards, grads)], clip)
            if step <= cfg.zenflow_full_warmup_steps:  # synchronous: no window
                open_window = []
            elif engine.schedule.windows_closed > closes_before:
                expected_windows.append(open_window)
                open_window = []
        engine.cpu.wait_update()
        assert engine.place == place
        return engine, shards, ref, expected_windows
    finally:
        if not keep_open:
            engine.close()


def assert_same(engine, shards, ref, states=True):
    for i, shard in enumerate(shards):
        assert torch.equal(shard.weights(), ref.weights[i]), f"weights of param {i}"
    if not states:  # the CPU side's states are in files: the weights carry them
        return
    states = engine_state(engine, shards)
    for i, shard in enumerate(shards):
        assert torch.equal(states["master"][i], ref.master[i]), f"master of param {i}"
        assert torch.equal(states["exp_avg"][i], ref.exp_avg[i]), f"exp_avg of param {i}"
        assert torch.equal(states["exp_avg_sq"][i], ref.exp_avg_sq[i]), f"exp_avg_sq {i}"


CASES = {
    "S3-k0.25-reselect6-warmup2": dict(zenflow_topk_ratio=0.25, zenflow_update_interval="3",
                                       zenflow_select_interval=6, zenflow_full_warmup_steps=2),
    "S1-k0.5-reselect1": dict(zenflow_topk_ratio=0.5, zenflow_update_interval="1",
                              zenflow_select_interval=1),
    "S4-k0.1-reselect8": dict(zenflow_topk_ratio=0.1, zenflow_update_interval="4",
                              zenflow_select_interval=8),
    "all-warmup-k0.3": dict(zenflow_topk_ratio=0.3, zenflow_full_warmup_steps=30,
                            zenflow_select_interval=4),
}


# Device accumulation does not use the host kernels: one run of it per case.
@pytest.mark.parametrize("kernels,place", [("c", "host"), ("torch", "host"), ("c", "device")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_engine_equals_reference(case, dtype, kernels, place, monkeypatch):
    """Either accumulation place (on the CPU the device is the CPU: the same code runs),
    either host kernel: the reference's states and weights, bit for bit."""
    if kernels == "torch":  # the path of machines without a C compiler
        monkeypatch.setattr(host_kernels, "load", lambda: None)
    elif host_kernels.load() is None:
        pytest.skip("no C compiler: the host kernels cannot be built")
    # Small chunks: the torch path's chunked fp32 conversion crosses chunk boundaries.
    monkeypatch.setattr(cpu_worker, "ACCUMULATE_CHUNK", 7)
    cfg = ZenFlowConfig(zenflow=True, **CASES[case])
    engine, shards, ref, _ = run_both(cfg, dtype, steps=25, place=place)
    assert (engine.cpu._kernels is not None) == (kernels == "c")
    assert_same(engine, shards, ref)
    if place == "device":  # one copy to the host per window (or synchronous step)
        windows = engine.schedule.windows_closed + min(25, cfg.zenflow_full_warmup_steps)
        assert engine.dev.transfers == windows > 0
    assert engine.retention == engine.retention  # re-selected at least once: not NaN


@pytest.mark.parametrize("dtype,case,place", [
    (dtype, case, "host") for dtype in (torch.float32, torch.bfloat16)
    for case in ("S3-k0.25-reselect6-warmup2", "S1-k0.5-reselect1", "S4-k0.1-reselect8")
] + [(torch.bfloat16, "S3-k0.25-reselect6-warmup2", "device")])
def test_cpu_side_in_offload_tiers_reselects_like_the_reference(tmp_path, case, dtype, place):
    """Re-selection with the CPU side's states in offload engines (files on two paths): every
    moment reaches its new side; each selection gets a new engine, the old one's files go.
    Also with the window sums made on the device (the engines read the accumulator the
    device's mean arrives in)."""
    made = []
    cfg = ZenFlowConfig(zenflow=True, **CASES[case])
    engine, shards, ref, _ = run_both(cfg, dtype, steps=25, keep_open=True, make_cpu_engine=(
        tiered_engine_factory(tmp_path, dtype, made)), place=place)
    try:
        assert_same(engine, shards, ref)
        assert len(made) >= 3  # the first selection and at least two re-selections
        assert engine.retention == engine.retention
        # Most subgroups are in files (a cache of three), all of them the engine's in use:
        # those of the earlier selections are gone.
        assert len(engine.states.engine.subgroups) > 6
        dirs = {f.parent.parent.name for f in tmp_path.rglob("sg*")}
        assert dirs == {f"test.selection{engine.states.generation}"}
    finally:
        engine.close()
    assert list(tmp_path.rglob("sg*")) == []


@pytest.mark.parametrize("kernels", ["c", "torch"])
@pytest.mark.parametrize("slots", [1, 2, 5, 9])
def test_batched_accumulation_equals_reference(slots, kernels, monkeypatch):
    """Steps added a few at a time (slots - 1 per pass, cut at window ends): same results."""
    if kernels == "torch":
        monkeypatch.setattr(host_kernels, "load", lambda: None)
    elif host_kernels.load() is None:
        pytest.skip("no C compiler: the host kernels cannot be built")
    monkeypatch.setenv("MEGATRON_EXT_ZENFLOW_STAGING_SLOTS", str(slots))
    for case in ("S4-k0.1-reselect8", "S3-k0.25-reselect6-warmup2"):
        cfg = ZenFlowConfig(zenflow=True, **CASES[case])
        engine, shards, ref, _ = run_both(cfg, torch.bfloat16, steps=25)
        assert engine.cpu.batch_steps == max(1, slots - 1)
        assert_same(engine, shards, ref)


def test_queued_steps_are_added_when_waited_for():
    """A step still queued (its batch not full) is added when its future is waited for."""
    cpu = cpu_worker.CpuWorker({0: 5}, torch.float32, pin=False)
    try:
        cpu.batch_steps = 4
        first = cpu.accumulate(0, {0: torch.ones(5)}, None, None)
        second = cpu.accumulate(0, {0: torch.full((5,), 2.0)}, None, 0.5)
        assert not first.done() and not second.done()
        first.result(timeout=30)  # starts the batch: both steps, one pass
        assert second.result(timeout=30) is None
        assert cpu.acc_steps[0] == 2
        assert torch.equal(cpu.acc[0][0], torch.full((5,), 2.0))
        last = cpu.accumulate(0, {0: torch.full((5,), 4.0)}, None, None, last=True)
        last.result(timeout=30)  # a window's last step never waits for a full batch
        assert torch.equal(cpu.acc[0][0], torch.full((5,), 2.0))  # (1 + 1 + 4) / 3
        assert cpu.acc_is_mean[0]
    finally:
        cpu.close()


def test_host_threads_run_on_the_cpus_given(monkeypatch):
    """MEGATRON_EXT_ZENFLOW_CPUS: the accumulate and Adam threads (and the workers they
    start) run on those CPUs; the calling thread keeps its own mask."""
    mine = os.sched_getaffinity(0)
    chosen = {max(mine)}
    monkeypatch.setenv("MEGATRON_EXT_ZENFLOW_CPUS", str(max(mine)))
    monkeypatch.delenv("MEGATRON_EXT_ZENFLOW_THREADS", raising=False)
    cpu = cpu_worker.CpuWorker({0: 3}, torch.float32, pin=False)
    try:
        assert cpu.cpus == chosen and cpu.threads == 1
        seen = [cpu._acc_pool.submit(os.sched_getaffinity, 0).result(timeout=30),
                cpu._update_pool.submit(os.sched_getaffinity, 0).result(timeout=30)]
        assert seen == [chosen, chosen]
        assert os.sched_getaffinity(0) == mine
    finally:
        cpu.close()


@pytest.mark.parametrize("allowed,machine,ranks,expected", [
    (range(16), 16, 1, range(2, 16)),          # the H200 machine: CPUs 2-15
    (range(128), 128, 8, range(16, 128)),      # eight ranks share a node: 2 CPUs each
    (range(32, 48), 128, 8, range(34, 48)),    # a rank bound to its own 16 CPUs
    (range(4), 4, 1, range(2, 4)),
    (range(3), 3, 1, None),                    # too few CPUs left: no confinement
    (range(16), 16, 8, None),
])
def test_default_host_cpus(allowed, machine, ranks, expected):
    got = cpu_affinity.default_host_cpus(set(allowed), machine, ranks)
    assert got == (set(expected) if expected is not None else None)


def knob_cpus() -> str:
    """The --zenflow-cpus knob as a run's config made now reads it (its variable)."""
    return ZenFlowConfig().zenflow_cpus


def test_host_cpus_default_only_on_request(monkeypatch):
    """Unset: no confinement on CPU runs, the default set for a CUDA GPU side; "all": none."""
    monkeypatch.delenv("MEGATRON_EXT_ZENFLOW_CPUS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    allowed = os.sched_getaffinity(0)
    assert cpu_affinity.host_cpus(knob_cpus()) is None
    assert cpu_affinity.host_cpus(knob_cpus(), default=True) == cpu_affinity.default_host_cpus(
        allowed, os.cpu_count(), 1, cpu_affinity.cpu_siblings(allowed))
    monkeypatch.setenv("MEGATRON_EXT_ZENFLOW_CPUS", "all")
    assert cpu_affinity.host_cpus(knob_cpus(), default=True) is None


def test_upload_buffers_are_written_after_the_guard():
    """The owner's upload_guard (its wait for an H2D copy still reading the upload
    buffers) runs before an update, masters_to_upload or new buffers write them."""
    cpu = cpu_worker.CpuWorker({0: 4}, torch.float32, pin=False)
    seen = []
    cpu.upload_guard = lambda: seen.append(cpu.upload[0].clone())
    try:
        cpu.set_masters({0: torch.full((4,), 3.0)})
        cpu.masters_to_upload()
        assert len(seen) == 1 and torch.equal(seen[0], torch.zeros(4))
        assert torch.equal(cpu.upload[0], torch.full((4,), 3.0))
        cpu.accumulate(0, {0: torch.ones(4)}, None, None, last=True)
        hp = HPARAMS[0]
        cpu.submit_update(0, 1, [hp])
        cpu.wait_update()
        assert len(seen) == 2 and torch.equal(seen[1], torch.full((4,), 3.0))
        assert not torch.equal(cpu.upload[0], torch.full((4,), 3.0))
    finally:
        cpu.close()


def test_after_update_runs_on_the_update_thread_once_the_weights_are_written():
    """The owner's after_update (where it starts the H2D copy of the new weights) runs on
    the update thread, after the update has written the upload buffers, before the
    update's future completes."""
    import threading

    cpu = cpu_worker.CpuWorker({0: 4}, torch.float32, pin=False)
    seen = []
    cpu.after_update = lambda: seen.append((threading.current_thread().name,
                                            cpu.upload[0].clone(),
                                            cpu.states.master[0].clone()))
    try:
        cpu.set_masters({0: torch.full((4,), 3.0)})
        cpu.accumulate(0, {0: torch.ones(4)}, None, None, last=True)
        cpu.submit_update(0, 1, [HPARAMS[0]])
        cpu.wait_update()
        assert len(seen) == 1
        name, upload, master = seen[0]
        assert name.startswith("zenflow-adam")
        assert not torch.equal(master, torch.full((4,), 3.0))  # Adam ran first
        assert torch.equal(upload, master)  # and the new weights were in the buffers
    finally:
        cpu.close()


@pytest.mark.parametrize("value,cpus", [("0", {0}), ("0,0-0", {0}), (" 0 ", {0})])
def test_host_cpus_parses_lists(monkeypatch, value, cpus):
    monkeypatch.setenv("MEGATRON_EXT_ZENFLOW_CPUS", value)
    if not cpus <= os.sched_getaffinity(0):
        pytest.skip("CPU 0 is not available to this process")
    assert cpu_affinity.host_cpus(knob_cpus()) == cpus
    monkeypatch.setenv("MEGATRON_EXT_ZENFLOW_CPUS", "3-1")
    with pytest.raises(UsageError, match="give CPU numbers and ranges"):
        cpu_affinity.host_cpus(knob_cpus())
    assert cpu_affinity.cpu_ranges({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


def test_selection_changes_sides():
    """The cases above really move columns: the selected set changes between selections."""
    cfg = ZenFlowConfig(zenflow=True, **CASES["S3-k0.25-reselect6-warmup2"])
    shards = make_shards(torch.float32)
    engine = ZenFlowEngine(cfg, shards, device=torch.device("cpu"), model_dtype=torch.float32,
                           grad_dtype=torch.float32)
    seen = set()
    try:
        for step in range(1, 26):
            for shard, g in zip(shards, grads_for(step, torch.float32)):
                shard.model_param.main_grad.copy_(g)
            engine.step(HPARAMS, None, None)
            seen.add(tuple(tuple(v.tolist()) for v in engine.selected.values()))
    finally:
        engine.close()
    assert len(seen) >= 3
    assert engine.retention < 1.0


@pytest.mark.parametrize("place,repeats", [("host", 8), ("device", 3)])
def test_windows_use_their_own_gradients_under_jitter(monkeypatch, place, repeats):
    """Random delays in the CPU threads: window w's update still sees window w's mean."""
    cfg = ZenFlowConfig(zenflow=True, **CASES["S3-k0.25-reselect6-warmup2"])
    for repeat in range(repeats):
        engine, shards, ref, expected = run_both(cfg, torch.float32, steps=20,
                                                 monkeypatch=monkeypatch, jitter=0.004,
                                                 place=place)
        assert_same(engine, shards, ref)
        windows = [t for t in engine.cpu.trace if t[0] >= 0]
        assert [w for w, _ in windows] == list(range(len(windows)))
        assert len(windows) == len(expected) >= 5
        for (window, seen), steps in zip(windows, expected):
            for group, mean in seen.items():
                # The engine adds step by step in fp32, then divides by the step count.
                acc = torch.zeros_like(steps[0][group])
                for s in steps:
                    acc += s[group]
                if len(steps) > 1:
                    acc /= len(steps)
                assert torch.equal(mean, acc), f"repeat {repeat} window {window} group {group}"


@pytest.mark.parametrize("saved,loaded", [("host", "host"), ("device", "device"),
                                          ("device", "host"), ("host", "device")])
def test_state_dict_round_trip_mid_window(saved, loaded):
    """Saved mid-window with an update pending: a restored engine continues identically,
    also with the accumulator on the device (its partial sum is in the state) and when the
    run resumes with the other accumulation place."""
    cfg = ZenFlowConfig(zenflow=True, zenflow_topk_ratio=0.25, zenflow_update_interval="3",
                        zenflow_select_interval=6)
    dtype = torch.bfloat16

    def feed(shards, step):
        for shard, g in zip(shards, grads_for(step, dtype)):
            shard.model_param.main_grad.copy_(g)

    a_shards = make_shards(dtype)
    a = ZenFlowEngine(dataclasses.replace(cfg, zenflow_accumulate=saved), a_shards,
                      device=torch.device("cpu"), model_dtype=dtype, grad_dtype=dtype)
    b_shards = make_shards(dtype)
    b = ZenFlowEngine(dataclasses.replace(cfg, zenflow_accumulate=loaded), b_shards,
                      device=torch.device("cpu"), model_dtype=dtype, grad_dtype=dtype)
    try:
        for step in range(1, 5):  # window 0 closed at 3 (pending), step 4 accumulated
            feed(a_shards, step)
            a.step(HPARAMS, None, clip_for(step))
        state = a.state_dict()
        assert state["upload_pending"] and state["acc_steps"][1] == 1
        assert a.place == saved and (a.dev.steps == 1) == (saved == "device")
        for sa, sb in zip(a_shards, b_shards):
            sb.weights().copy_(sa.weights())
        b.load_state_dict(state)
        for step in range(5, 16):
            for shards, engine in ((a_shards, a), (b_shards, b)):
                feed(shards, step)
                engine.step(HPARAMS, None, clip_for(step))
        for sa, sb in zip(a_shards, b_shards):
            assert torch.equal(sa.weights(), sb.weights())
        assert b.place == loaded
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kernels", ["c", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_device_sum_equals_host_sum_bit_for_bit(dtype, kernels, monkeypatch):
    """The device accumulator and the CPU worker's, over windows of 3 steps (a divisor that
    is not a power of two) with an inverse loss scale and a clip coefficient on some steps:
    the same window means bit for bit."""
    from megatron_ext.zenflow.accumulation import DeviceAccumulator

    if kernels == "torch":
        monkeypatch.setattr(host_kernels, "load", lambda: None)
    elif host_kernels.load() is None:
        pytest.skip("no C compiler: the host kernels cannot be built")
    sizes = {0: 1000, 1: 37}
    host = cpu_worker.CpuWorker(sizes, torch.float32, pin=False)
    dev = DeviceAccumulator(torch.device("cpu"))
    dev.resize(sizes)
    out = {g: torch.empty(n) for g, n in sizes.items()}
    gen = torch.Generator().manual_seed(7)
    try:
        host.batch_steps = 2
        for window in range(3):
            buffer = window % 2
            for step in range(3):
                grads = {g: (torch.randn(n, generator=gen) * 1e3).to(dtype)
                         for g, n in sizes.items()}
                inv = torch.tensor(1 / 1024.0 * (1 + step)) if step != 1 else None
                clip = 0.37 if step == 2 else None
                host.accumulate(buffer, grads, inv, clip, last=step == 2)
                dev.add(grads, inv, clip)
            host.wait_accumulate()
            steps, ready = dev.drain(out)
            assert steps == 3 and ready is None and dev.steps == 0
            for group in sizes:
                assert torch.equal(out[group], host.acc[buffer][group]), (window, group)
                assert torch.equal(dev.acc[group], torch.zeros(sizes[group]))
            host._consumed(buffer)
        assert dev.transfers == 3
    finally:
        host.close()


@pytest.mark.parametrize("free,place", [(None, "host"), (10 ** 12, "device"), (10, "host")])
def test_auto_place_from_the_injected_free_memory(free, place):
    """--zenflow-accumulate auto: the free memory the hook reports at the first step picks
    the place (no measure, a CPU run: host); both places train like the reference."""
    cfg = ZenFlowConfig(zenflow=True, **CASES["S4-k0.1-reselect8"])
    shards = make_shards(torch.bfloat16)
    ref = Reference(make_shards(torch.bfloat16), cfg)
    calls = []

    def free_memory():
        calls.append(engine.gpu_steps)
        return free, None
    engine = ZenFlowEngine(cfg, shards, device=torch.device("cpu"), model_dtype=torch.bfloat16,
                           grad_dtype=torch.bfloat16, free_memory=free_memory)
    try:
        for step in range(1, 13):
            grads = grads_for(step, torch.bfloat16)
            for shard, g in zip(shards, grads):
                shard.model_param.main_grad.copy_(g)
            engine.step(HPARAMS, None, clip_for(step))
            ref.step([g.view(-1)[s.start:s.end] for s, g in zip(shards, grads)], clip_for(step))
        engine.cpu.wait_update()
        assert calls == [0]  # measured once, at the first step, before any accumulation
        assert engine.place == place, engine.place_reason
        record = engine.metrics()
        assert record["zenflow/accumulate_on_device"] == float(place == "device")
        # 12 steps, windows of 4: one copy per window on the device, one per step on the host.
        assert record["zenflow/d2h_copies"] == (3 / 12 if place == "device" else 1.0)
        assert record["zenflow/pcie_bytes"] > 0 and 0 <= record["zenflow/stall_share"] < 1
        assert record["zenflow/host_thread_s"] > 0
        assert (record["zenflow/device_acc_gib"] > 0) == (place == "device")
        assert_same(engine, shards, ref)
    finally:
        engine.close()


@pytest.mark.parametrize("case", ["S3-k0.25-reselect6-warmup2", "S1-k0.5-reselect1",
                                  "S4-k0.1-reselect8"])
def test_reselection_with_reused_upload_buffers_keeps_the_old_engines_weights(
        tmp_path, case, monkeypatch):
    """On a GPU machine the upload buffers are page-locked and reused across re-selections
    (``CpuWorker._pinned_views``): the new engine's fill writes its weights into the very
    memory where the old engine's masters keep their bf16 half (remainders), while later
    pieces of the fill still read the old masters. Simulated here without pinning: the
    reference's states and weights, bit for bit, through every re-selection (both fill
    orders: the fill runs opposite to the next step's alternating order)."""
    from megatron_ext.offload import blockio

    monkeypatch.setattr(blockio, "aligned_empty",
                        functools.partial(_unpinned, blockio.aligned_empty))
    monkeypatch.setattr(cpu_worker.CpuWorker, "_upload_buffers",
                        lambda self, sizes: self._pinned_views("upload", sizes, self.model_dtype))
    from megatron_ext.zenflow import cpu_states

    shared = []
    keep_for = cpu_states.keep_for
    monkeypatch.setattr(cpu_states, "keep_for",
                        lambda old, new: shared.append(keep_for(old, new)) or shared[-1])
    made = []
    cfg = ZenFlowConfig(zenflow=True, **CASES[case])
    engine, shards, ref, _ = run_both(cfg, torch.bfloat16, steps=25, keep_open=True,
                                      make_cpu_engine=tiered_engine_factory(
                                          tmp_path, torch.bfloat16, made))
    try:
        assert engine.states.engine.layout.remainders
        assert len(made) >= 3
        # The reuse really happened: new engines wrote where old ones kept their weights.
        assert sum(kept is not None for kept in shared) >= 2
        assert_same(engine, shards, ref)
    finally:
        engine.close()


def _unpinned(aligned_empty, nbytes, dtype=torch.uint8, pin=False):
    return aligned_empty(nbytes, dtype, pin=False)
