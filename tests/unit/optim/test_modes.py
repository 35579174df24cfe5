"""The optimizer mode registry: which mode a run has, its rules, and a new mode's reach."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types

import pytest

from megatron_ext.checkpoint import integrity, load_checks
from megatron_ext.config import parse_config
from megatron_ext.errors import UsageError
from megatron_ext.optim import modes
from megatron_ext.training.metrics import format_line
from megatron_ext.training.optimizer import build_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
REQUIRED = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
            "--lr", "1e-3", "--train-iters", "2", "--mock-data", "--vocab-size", "100"]
DIST = ["--use-distributed-optimizer"]
RECORD = {"iteration": 10, "consumed_samples": 40, "time/iteration_s": 0.05, "lr": 1e-3,
          "global_batch_size": 4, "lm_loss": 5.0, "loss_scale": 1.0, "grad_norm": 1.0,
          "skipped_iterations": 0, "throughput/tokens_per_s": 100.0,
          "throughput/tflops_per_gpu": 0.0, "time/forward_s": 0.01}


def config(*flags):
    return parse_config([*REQUIRED, *flags])


def test_registry_holds_the_built_in_modes_in_order():
    assert [mode.name for mode in modes.modes()][:3] == ["plain", "offload", "zenflow"]
    assert [mode.flag for mode in modes.modes()][:3] == ["", "--offload-optimizer", "--zenflow"]


@pytest.mark.parametrize("flags, name", [
    ([], "plain"),
    (DIST, "plain"),
    ([*DIST, "--optimizer-cpu-offload"], "plain"),
    ([*DIST, "--offload-optimizer"], "offload"),
    ([*DIST, "--zenflow"], "zenflow"),
    # ZenFlow with its CPU states in the offload engine's tiers.
    ([*DIST, "--zenflow", "--offload-optimizer"], "zenflow"),
])
def test_mode_of_each_flag_combination(flags, name):
    cfg = config(*flags)
    assert modes.mode_of(cfg).name == name
    # A saved config (a checkpoint's) gives the same mode.
    assert modes.mode_of(cfg.to_dict()).name == name


@pytest.mark.parametrize("saved, words", [
    ({}, "the plain optimizer"),
    ({"offload": {"offload_optimizer": False}}, "the plain optimizer"),
    ({"offload": {"offload_optimizer": True}}, "--offload-optimizer"),
    ({"zenflow": {"zenflow": True}}, "--zenflow"),
    ({"zenflow": {"zenflow": True}, "offload": {"offload_optimizer": True}}, "--zenflow"),
])
def test_optimizer_kind_of_saved_configs(saved, words):
    assert load_checks.optimizer_kind(saved) == words


@pytest.mark.parametrize("flags, message", [
    (["--optimizer-cpu-offload"], "--optimizer-cpu-offload needs --use-distributed-optimizer"),
    ([*DIST, "--optimizer-cpu-offload", "--optimizer", "sgd"],
     "--optimizer-cpu-offload supports --optimizer adam only"),
    ([*DIST, "--optimizer-cpu-offload", "--fp16"],
     "--optimizer-cpu-offload does not support --fp16; use --bf16"),
    (["--offload-optimizer"], "--offload-optimizer offloads the distributed optimizer's shard: "
                              "add --use-distributed-optimizer"),
    ([*DIST, "--offload-optimizer", "--optimizer-cpu-offload"],
     "--offload-optimizer and --optimizer-cpu-offload are two offloads of the same states; "
     "choose one"),
    ([*DIST, "--offload-optimizer", "--optimizer", "sgd"],
     "--offload-optimizer supports --optimizer adam only"),
    (["--use-precision-aware-optimizer"],
     "--use-precision-aware-optimizer is honoured by --offload-optimizer only: megatron-core "
     "implements it with Transformer Engine's FusedAdam, which this project does not wire; add "
     "--offload-optimizer or drop the flag"),
    ([*DIST, "--zenflow", "--offload-optimizer", "--offload-device-cache-gb", "1"],
     "--zenflow keeps its own GPU states: --use-precision-aware-optimizer and "
     "--offload-device-cache-gb apply to --offload-optimizer alone"),
    (["--zenflow"], "--zenflow splits the distributed optimizer's shard between the GPU and the "
                    "CPU: add --use-distributed-optimizer"),
    ([*DIST, "--zenflow", "--optimizer-cpu-offload"],
     "--zenflow and --optimizer-cpu-offload both move optimizer states to the host; choose one"),
    ([*DIST, "--zenflow", "--optimizer", "sgd"], "--zenflow supports --optimizer adam only"),
    # Several rules broken at once: the same one wins as before the registry.
    (["--optimizer-cpu-offload", "--offload-optimizer"],
     "--optimizer-cpu-offload needs --use-distributed-optimizer"),
    (["--offload-optimizer", "--zenflow", "--offload-device-cache-gb", "auto"],
     "--offload-optimizer offloads the distributed optimizer's shard: add "
     "--use-distributed-optimizer"),
    (["--zenflow", "--use-precision-aware-optimizer"],
     "--use-precision-aware-optimizer is honoured by --offload-optimizer only: megatron-core "
     "implements it with Transformer Engine's FusedAdam, which this project does not wire; add "
     "--offload-optimizer or drop the flag"),
])
def test_requirements_give_their_exact_messages(flags, message):
    with pytest.raises(UsageError) as err:
        config(*flags)
    assert str(err.value) == message


def test_requirement_applies_only_while_its_flag_is_set():
    rule = modes.refuses("training.fp16", "no fp16", when="optimizer.optimizer_cpu_offload")
    cfg = config("--fp16")
    rule.check(cfg)  # no --optimizer-cpu-offload: the rule does not apply
    cfg.optimizer.optimizer_cpu_offload = True
    with pytest.raises(UsageError, match="^no fp16$"):
        rule.check(cfg)


def test_offload_summary_on_the_line():
    record = {**RECORD, "offload/cache_hit_rate": 0.5, "offload/stall_s": 0.001,
              "offload/update_s": 0.0025, "offload/fetch_bg_s": 0.004, "offload/io_bytes": 3e9}
    line = format_line(record, 100)
    assert ("| offload (ms): stall 1.0 convert 0.0 update 2.5 writeback 0.0, io threads fetch "
            "4.0 flush 0.0 lock wait 0.0, cache hits 50%, io 3.00 GB |") in line
    assert "offload" not in format_line(RECORD, 100)


def test_metric_section_formats_what_the_record_has():
    fields = (("a", "A", ".2f"), ("b_s", "B (ms)", "ms"), ("c", "C", ".0%"))
    assert modes.metric_section({"x/a": 1.234, "x/c": 0.5}, "x", fields) == "x: A 1.23 C 50%"
    assert modes.metric_section({"x/b_s": 0.0021}, "x", fields) == "x: B (ms) 2.1"
    assert modes.metric_section({"y/a": 1.0}, "x", fields) is None


def test_a_mode_name_is_registered_once(isolated_registry):
    with pytest.raises(ValueError, match="registered already"):
        modes.register(modes.PlainMode())


@pytest.fixture
def isolated_registry(monkeypatch):
    """A copy of the registry that the test may add to."""
    monkeypatch.setattr(modes, "_REGISTRY", dict(modes._REGISTRY))


class FakeMode(modes.Mode):
    """A mode that no training code knows of."""

    name = "fake"
    flag = "--fake"
    words = "the fake optimizer"
    precedence = 10
    on = False
    requirements = (modes.refuses("training.fp16", "--fake does not support --fp16"),)

    def enabled(self, cfg):
        return self.on

    def build(self, cfg, model_chunks, runtime, plan=None):
        return ("built by fake", model_chunks, runtime)

    def log_summary(self, record):
        value = record.get("fake/speed")
        return None if value is None else f"fake: speed {value:.1f}"

    def checkpoint_problems(self, directory):
        path = os.path.join(directory, "fake.json")
        return [] if not os.path.exists(path) else [("fake.json", "fake state: stale")]


def test_a_new_mode_is_built_and_asked_without_touching_training_code(isolated_registry,
                                                                       tmp_path):
    fake = modes.register(FakeMode())
    assert modes.modes()[-1] is fake
    cfg = config()
    assert modes.mode_of(cfg).name == "plain"  # not enabled
    fake.on = True
    try:
        # The optimizer seam builds it.
        assert modes.mode_of(cfg) is fake
        assert build_optimizer(cfg, ["chunk"], "runtime") == ("built by fake", ["chunk"],
                                                              "runtime")
        # The config checks its rules.
        with pytest.raises(UsageError, match="^--fake does not support --fp16$"):
            config("--fp16")
        # The checkpoint load names it.
        assert load_checks.optimizer_kind(cfg) == "the fake optimizer"
        # The memory plan asks it (the default: megatron-core's states on the GPU).
        from megatron_ext.memory.machine import Machine
        from megatron_ext.memory.plan import plan_run

        cfg.check_world(1)
        plan = plan_run(cfg, 100, 1, Machine("m", 10**9, 10**9, 10**10))
        assert plan.mode == "fake" and "optimizer states" in plan.gpu.items
    finally:
        fake.on = False
    # Its part of the stdout line, after the other modes' and before the ETA.
    line = format_line({**RECORD, "fake/speed": 2.25, "zenflow/rho": 0.5, "time/eta_s": 1.0},
                       100)
    assert line.endswith("| zenflow: rho 0.500 | fake: speed 2.2 | ETA 00:00:01 |"), line
    # The checkpoint integrity check asks it about its own files.
    (tmp_path / "fake.json").write_text(json.dumps({}))
    has_manifest, problems = integrity.find_problems(str(tmp_path))
    assert has_manifest is False and problems == [("fake.json", "fake state: stale")]
    integrity.write_manifest(str(tmp_path))
    with pytest.raises(UsageError, match="fake.json: fake state: stale"):
        integrity.verify(str(tmp_path))


def test_checkpoint_problems_include_the_offload_manifests(tmp_path):
    directory = tmp_path / "offload" / "rank00000"
    directory.mkdir(parents=True)
    (directory / "manifest.json").write_text(json.dumps(
        {"step": 1, "rank": 0, "subgroups": [{"subgroup": 0, "elements": 4,
                                              "file": "sg00000.state"}]}))
    name = os.path.join("offload", "rank00000", "manifest.json")
    assert modes.checkpoint_problems(str(tmp_path)) == [
        (name, "offload manifest: lists sg00000.state, which is missing")]
    (directory / "sg00000.state").write_bytes(b"\0" * 16)
    assert modes.checkpoint_problems(str(tmp_path)) == []


def test_registry_is_complete_in_a_process_that_builds_no_trainer():
    """The checkpoint checks in tools/ see every mode; config and the modes import no torch."""
    code = ("import sys\n"
            "from megatron_ext.checkpoint import integrity\n"
            "import megatron_ext.config\n"
            "from megatron_ext.optim.modes import modes\n"
            "print(' '.join(m.name for m in modes()))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    assert out.split() == ["plain", "offload", "zenflow"]
    light = ("import sys\n"
             "import megatron_ext.config\n"
             "from megatron_ext.optim.modes import modes\n"
             "modes()\n"
             "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", light], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    assert out.strip() == "False"


def test_plain_mode_refuses_megatron_host_offload_on_the_cpu():
    cfg = config(*DIST, "--optimizer-cpu-offload")
    with pytest.raises(UsageError, match="^--optimizer-cpu-offload is megatron-core's "
                                         "GPU-to-host offload and needs a GPU"):
        build_optimizer(cfg, [], types.SimpleNamespace(is_cpu=True, rank=0))


# ---------------------------------------------------------------- the memory plan's needs


def _shape(cfg):
    from megatron_ext.memory.shape import model_shape

    cfg.check_world(1)
    return model_shape(cfg, 100, 1)


@pytest.mark.parametrize("flags, masters, moments", [
    ([], 0, 8),                    # fp32 weights are their own masters
    (["--bf16"], 4, 8),            # fp32 masters beside bf16 weights
    (["--optimizer", "sgd"], 0, 4),
])
def test_plain_mode_keeps_megatron_cores_states_on_the_gpu(flags, masters, moments,
                                                           monkeypatch):
    monkeypatch.setattr(modes, "torch_adam_is_megatrons", lambda: False)  # TE's FusedAdam
    cfg = config(*DIST, *flags)
    shape = _shape(cfg)
    needs = modes.mode_of(cfg).memory_needs(cfg, shape)
    assert needs.gpu == {"optimizer states": shape.shard_elements * (masters + moments)}
    assert needs.host == {} and needs.tiered is None
    assert needs.gpu_fix == "add --offload-optimizer"


@pytest.mark.parametrize("torch_adam", [True, False], ids=["torch-adamw", "fused-adam"])
@pytest.mark.parametrize("flags, copies", [
    (["--bf16"], False),                          # fp32 gradients: the main grads are views
    (["--bf16", "--grad-reduce-in-bf16"], True),  # bf16 gradients: .float() copies
    ([], False),                                  # fp32 training
])
def test_the_optimizer_steps_transients_are_counted(torch_adam, flags, copies, monkeypatch):
    """torch's foreach AdamW takes sqrt(exp_avg_sq) of a whole param group into new tensors
    (4 B per element; what Megatron-LM's Llama-3-8B plain run on one H200 met beyond a plan
    without it; TE's and apex's FusedAdam take none), and bf16 gradients get fp32 copies
    (4 B per element). Both during the step only: beyond the activations' memory."""
    monkeypatch.setattr(modes, "torch_adam_is_megatrons", lambda: torch_adam)
    cfg = config(*DIST, *flags)
    shape = _shape(cfg)
    step = 4 * shape.shard_elements * (int(torch_adam) + int(copies))
    gpu = modes.mode_of(cfg).memory_needs(cfg, shape).gpu
    excess = step - shape.activation_bytes
    assert gpu.get(modes.STEP_ITEM) == (excess if excess > 0 else None)
    if torch_adam and copies:  # the tiny shape: both transients together pass its activations
        assert excess > 0


def test_the_step_needs_nothing_beyond_activations_larger_than_it(monkeypatch):
    monkeypatch.setattr(modes, "torch_adam_is_megatrons", lambda: True)
    cfg = config(*DIST, "--bf16")
    shape = _shape(cfg)
    shape = dataclasses.replace(shape, activation_bytes=8 * shape.shard_elements)
    assert modes.STEP_ITEM not in modes.mode_of(cfg).memory_needs(cfg, shape).gpu
    sgd = config(*DIST, "--bf16", "--optimizer", "sgd")
    assert modes.STEP_ITEM not in modes.mode_of(sgd).memory_needs(sgd, _shape(sgd)).gpu


def test_this_machines_megatron_adam_is_torchs():
    """No Transformer Engine or apex here (requirements.txt installs neither)."""
    assert modes.torch_adam_is_megatrons()


def test_plain_mode_with_megatron_cores_host_offload():
    cfg = config(*DIST, "--bf16", "--optimizer-cpu-offload", "--optimizer-offload-fraction",
                 "0.5")
    shape = _shape(cfg)
    needs = modes.mode_of(cfg).memory_needs(cfg, shape)
    n = shape.shard_elements
    assert needs.gpu["optimizer states"] == 4 * n + (n - n // 2) * 8
    assert needs.host["optimizer states (megatron-core)"] == (n // 2) * 16


def test_offload_mode_puts_the_states_in_the_tiers():
    cfg = config(*DIST, "--bf16", "--offload-optimizer", "--offload-subgroup-size", "1000",
                 "--offload-host-cache-gb", "0.5", "--offload-device-cache-gb", "auto")
    shape = _shape(cfg)
    needs = modes.mode_of(cfg).memory_needs(cfg, shape)
    states = needs.tiered
    assert (states.elements, states.arrays, states.subgroup_size) == (
        shape.shard_elements, (2, 4, 4), 1000)
    assert states.device_bytes is None and states.host_bytes == 5 * 10**8
    assert states.path_reserve_bytes == 3 * 10000
    # The engine's own placement over the paths (bandwidth-proportional, interleaved).
    assert states.place([10, 10, 10, 10], [1.0, 1.0], [100, 100]) == [0, 1, 0, 1]


def test_offload_paths_keep_room_for_the_engines_spare_files():
    from megatron_ext.offload import io
    from megatron_ext.offload.mode import PATH_SPARE_FILES

    assert PATH_SPARE_FILES == io.SPARES_PER_SIZE + 1


def test_zenflow_mode_splits_selected_and_delayed_columns():
    cfg = config(*DIST, "--bf16", "--zenflow", "--zenflow-topk-ratio", "0.25",
                 "--zenflow-accumulate", "host")
    shape = _shape(cfg)
    needs = modes.mode_of(cfg).memory_needs(cfg, shape)
    vectors = shape.rank_vector_params
    selected = -(-(shape.shard_elements - vectors) // 4)
    delayed = shape.shard_elements - vectors - selected
    assert needs.gpu["ZenFlow GPU states"] == (selected + vectors) * 12
    assert needs.host["ZenFlow CPU states"] == 12 * delayed
    assert needs.host["ZenFlow accumulators"] == (8 + 3 * 4) * delayed  # fp32 grads
    assert needs.tiered is None
