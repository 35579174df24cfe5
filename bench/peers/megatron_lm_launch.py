"""Megatron-LM's own ``pretrain_gpt.py`` with two resume fixes, optionally on the CPU.

Runs it from its source in ``MLM_DIR`` (tags core_v0.16.1 and core_v0.19.0); the fixes are
for its megatron-core without Apex or Transformer Engine.

Used by ``bench/peers/megatron_lm_resume.sh``; not part of this project's training path.

Usage: ``MLM_DIR=/path/to/megatron-lm python bench/peers/megatron_lm_launch.py [--cpu] FLAGS...``
(under torchrun on a GPU: ``torchrun --nproc-per-node 1 bench/peers/megatron_lm_launch.py FLAGS``).

Without Apex or Transformer Engine, megatron-core's ``DistributedOptimizer`` (0.16.1, and
still at core_v0.19.0) uses torch's AdamW, and Megatron-LM cannot resume any ``torch_dist``
checkpoint with its optimizer, its own included:

1. ``DistributedOptimizer.state_dict()`` asserts (``assert len(steps) == 1``) when torch's
   Adam has no state yet, which is always the case when ``load_checkpoint`` builds the
   sharded state dict before the first step. Fix: before that, the states are made the way
   megatron-core makes them for its FSDP path (``_init_optimizer_states_with_dummy_values``);
   the load then overwrites them.
2. After the load every parameter's ``step`` is the one of those dummy states (or, without
   fix 1, one tensor shared by all parameters, which torch's foreach Adam then increments
   once per parameter), not its group's step from the checkpoint: the first update after
   the resume uses the wrong bias correction (on the CPU the next iteration's grad norm was
   1.659 or 1.709 instead of 1.670). Fix: each parameter's step is set from its group's.

Both are still needed at core_v0.19.0 (checked on the CPU, 2026-12-03; ``MLM_RESUME_FIXES``
turns them off): without fix 1 the load stops at that assert; without fix 2 every step is
one tensor shared by all parameters holding the dummy step 1 where the checkpoint says 4
(the next grad norm 1.931 instead of 1.908, and 9 of the 12 tensors of the checkpoint four
iterations later differ from the uninterrupted run's, which with both fixes it equals bit
for bit). The log says when each acts and what it found; fix 2 also acts on megatron-core's
own ``load_state_dict(state_dict())`` round trip while the load is prepared (on the dummy
states: harmless, and said so).

Neither fix is applied when Apex or Transformer Engine is importable (megatron-core then
uses their fused Adam and another path).

``--cpu``: Megatron-LM's training on the CPU through this project's CUDA-to-CPU layer
(``megatron_ext.runtime.cpu_compat``) plus stand-ins for the few CUDA calls Megatron-LM's
own training makes (a GPU to Megatron-LM's code only, device count, CUDA generator state:
the CPU's, the nvcc version check of its legacy fused kernels), its dataset helpers built
for the running interpreter, gloo instead of nccl, and its torch.compile'd fusions off
(``--no-bias-swiglu-fusion --no-bias-dropout-fusion``; the JIT warm-up is skipped). Works
with a CPU build of torch and with a CUDA build on a machine without a driver (PyPI's only
torch for Python 3.12, which core_v0.19.0 needs). A functional check of flags, checkpoint
load and save: not a measurement, and not the GPU.
"""
from __future__ import annotations

import os
import runpy
import sys

import torch


def _megatron_sees_a_gpu(torch_is_available):
    """``torch.cuda.is_available`` that says True to Megatron-LM and the truth to torch.

    Megatron-LM asserts a GPU at start-up (``initialize.py``: "Megatron requires CUDA.").
    torch itself asks the same function (through ``torch.accelerator.is_available()``)
    before it touches the driver: the DataLoader's ``pin_memory``, Adam's graph-capture
    check (``Optimizer._accelerator_graph_capture_health_check``). A global True was
    harmless with a CPU build of torch (no accelerator compiled in: those checks never
    reach ``is_available``), but torch's CUDA build (the only one PyPI has for Python 3.12,
    which Megatron-LM core_v0.19.0 needs) then initializes the absent driver and fails. So
    the answer depends on the caller: code outside ``torch`` (Megatron-LM, megatron-core)
    sees a GPU, torch's own modules get the real answer (False on this machine).
    """

    def is_available() -> bool:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller == "torch" or caller.startswith("torch."):
            return torch_is_available()
        return True

    return is_available


def cpu_stand_ins() -> None:
    """Megatron-LM on a machine without a GPU.

    This project's CUDA-to-CPU layer, one-process torchrun variables, and stand-ins for the
    torch.cuda calls Megatron-LM makes itself.
    """
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29563")
    from megatron_ext.runtime import cpu_compat

    cpu_compat.install()
    cuda = torch.cuda
    cuda.is_available = _megatron_sees_a_gpu(cuda.is_available)
    cuda.device_count = lambda: 1
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda *a, **k: None
    cuda.manual_seed_all = lambda *a, **k: None
    cuda.get_device_capability = lambda *a, **k: (9, 0)
    cuda.get_device_name = lambda *a, **k: "cpu"
    cuda.set_stream = lambda *a, **k: None
    cuda.mem_get_info = lambda *a, **k: (0, 0)
    cuda.memory_stats = lambda *a, **k: {}
    # Megatron-LM's legacy fused kernels read `nvcc -V` from CUDA_HOME at start-up.
    import tempfile

    import torch.utils.cpp_extension as cpp_extension

    fake = tempfile.mkdtemp(prefix="mlm-cuda-home-")
    os.makedirs(os.path.join(fake, "bin"))
    nvcc = os.path.join(fake, "bin", "nvcc")
    with open(nvcc, "w") as f:
        f.write('#!/bin/sh\necho "Cuda compilation tools, release 12.4, V12.4.131"\n')
    os.chmod(nvcc, 0o755)
    cpp_extension.CUDA_HOME = fake
    import megatron.training.initialize as mlm_initialize

    mlm_initialize._warmup_jit_function = lambda *a, **k: None
    _helpers_for_this_interpreter()


def _helpers_for_this_interpreter() -> None:
    """Megatron-LM's dataset helpers built for the interpreter that runs them.

    Its ``compile_helpers`` runs ``make``, whose Makefile asks ``python3`` (pybind11's
    include flags) and ``python3-config`` (the extension suffix) on PATH: not necessarily
    this interpreter. Under pyenv the tags' own ``.python-version`` (3.12) picks them inside
    MLM_DIR, so a Python 3.11 run got a ``cpython-312`` module it cannot import. The same
    ``make``, with the include flags and the suffix of ``sys.executable`` given on its
    command line (pybind11 must be importable here).
    """
    import subprocess
    import sysconfig

    from megatron.core.datasets import utils as dataset_utils

    def compile_helpers() -> None:
        includes = subprocess.run([sys.executable, "-m", "pybind11", "--includes"],
                                  capture_output=True, text=True, check=False)
        if includes.returncode != 0:
            sys.exit(f"error: {sys.executable} -m pybind11 failed (Megatron-LM compiles its "
                     f"dataset helpers with it): pip install pybind11\n{includes.stderr}")
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        _say(f"dataset helpers: make with {sys.executable}'s pybind11 includes and {suffix}")
        folder = os.path.dirname(os.path.abspath(dataset_utils.__file__))
        command = ["make", "-C", folder, f"CPPFLAGS={includes.stdout.strip()}",
                   f"LIBEXT={suffix}"]
        if subprocess.run(command, check=False).returncode != 0:
            sys.exit("error: compiling Megatron-LM's dataset helpers failed (see above)")

    dataset_utils.compile_helpers = compile_helpers


def _fixes_wanted() -> set[int]:
    """The resume fixes that ``MLM_RESUME_FIXES`` asks for.

    ``1,2`` (the default), ``1``, ``2`` or ``none`` (to see whether a Megatron-LM version
    still needs them).
    """
    value = os.environ.get("MLM_RESUME_FIXES", "1,2").strip()
    if value == "none":
        return set()
    wanted = {part.strip() for part in value.split(",")}
    if not wanted <= {"1", "2"}:
        sys.exit(f"error: MLM_RESUME_FIXES={value!r}: give 1,2 (the default), 1, 2 or none")
    return {int(part) for part in wanted}


def _say(message: str) -> None:
    print(f"megatron_lm_launch: {message}", flush=True)


def _optimizer_resume_fixes() -> None:
    """Installs the two resume fixes (the module docstring says why).

    Each says in the log when it acts and what it found.
    """
    from megatron.core.optimizer import distrib_optimizer as do

    if do.HAVE_APEX_OR_TE:
        _say("Apex or Transformer Engine importable: no resume fixes")
        return
    wanted = _fixes_wanted()
    _say(f"no Apex or Transformer Engine: resume fixes for torch's AdamW installed: "
         f"{sorted(wanted) or 'none'} (MLM_RESUME_FIXES; bench/peers/megatron_lm_launch.py)")
    sharded_state_dict = do.DistributedOptimizer.sharded_state_dict
    load_state_dict = do.DistributedOptimizer.load_state_dict
    # While the load is prepared, megatron-core itself calls load_state_dict(state_dict()).
    preparing = {"load": False}

    def sharded_with_states(self, model_sharded_state_dict, is_loading=False, **kwargs):
        if is_loading and not self.optimizer.state:
            if 1 in wanted:
                _say("fix 1 applied: torch's AdamW has no state before the load; dummy states "
                     "made (as megatron-core's FSDP path does), the load overwrites them")
                self._init_optimizer_states_with_dummy_values()
            else:
                _say("fix 1 would apply (torch's AdamW has no state before the load); off")
        preparing["load"] = is_loading
        try:
            return sharded_state_dict(self, model_sharded_state_dict, is_loading, **kwargs)
        finally:
            preparing["load"] = False

    def load_with_group_steps(self, state_dict):
        load_state_dict(self, state_dict)
        source = ("megatron-core's round trip while it prepares the load, on the dummy states"
                  if preparing["load"] else "the checkpoint's optimizer state")
        for index, group in enumerate(self.optimizer.param_groups):
            if "step" not in group:
                continue
            states = [self.optimizer.state[p] for p in group["params"]
                      if "step" in self.optimizer.state.get(p, {})]
            found = sorted({float(s["step"]) for s in states})
            shared = len({id(s["step"]) for s in states}) < len(states)
            right = found == [float(group["step"])] and not shared
            if right:
                _say(f"fix 2 not needed in param group {index} ({source}): each of its "
                     f"{len(states)} steps is its own tensor holding the group's step "
                     f"{group['step']}")
                continue
            what = (f"param group {index}, {source}: group step {group['step']}, "
                    f"per-parameter steps {found}"
                    f"{' (tensors shared between parameters)' if shared else ''}")
            if 2 not in wanted:
                _say(f"fix 2 would apply ({what}); off")
                continue
            _say(f"fix 2 applied ({what}): each step set from the group's")
            for state in states:
                state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype,
                                             device=state["step"].device)

    do.DistributedOptimizer.sharded_state_dict = sharded_with_states
    do.DistributedOptimizer.load_state_dict = load_with_group_steps


def main() -> None:
    """Applies the fixes (and the CPU stand-ins with --cpu), then runs pretrain_gpt.py."""
    mlm = os.environ.get("MLM_DIR")
    if not mlm or not os.path.isfile(os.path.join(mlm, "pretrain_gpt.py")):
        sys.exit("error: MLM_DIR must name Megatron-LM's source directory (with pretrain_gpt.py)")
    sys.path.insert(0, mlm)
    flags = sys.argv[1:]
    cpu = "--cpu" in flags
    flags = [f for f in flags if f != "--cpu"]
    if cpu:
        cpu_stand_ins()
        flags += ["--distributed-backend", "gloo", "--no-bias-swiglu-fusion",
                  "--no-bias-dropout-fusion"]
    _optimizer_resume_fixes()
    script = os.path.join(mlm, "pretrain_gpt.py")
    sys.argv = [script, *flags]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
