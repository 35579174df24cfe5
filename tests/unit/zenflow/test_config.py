"""ZenFlow's config: --zenflow-cpu-states settled by the run's config, the knobs' values.

Proven here: auto becomes tiers with --offload-optimizer and host without, once, in the
run's config; tiers without --offload-optimizer is refused in one line; the knobs take
their variables (with the old messages) and never count as flags given without --zenflow;
the builder refuses an unsettled auto.
"""

from __future__ import annotations

import pytest

from megatron_ext.config import parse_config
from megatron_ext.errors import UsageError
from megatron_ext.zenflow.config import STAGING_SLOTS, ZenFlowConfig

MIN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
       "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
       "--lr", "1e-3", "--train-iters", "2", "--mock-data", "--vocab-size", "100",
       "--use-distributed-optimizer"]


@pytest.mark.parametrize("flags,expected", [
    (["--zenflow"], "host"),
    (["--zenflow", "--offload-optimizer"], "tiers"),
    (["--zenflow", "--offload-optimizer", "--zenflow-cpu-states", "host"], "host"),
    (["--zenflow", "--zenflow-cpu-states", "host"], "host"),
    (["--zenflow", "--offload-optimizer", "--zenflow-cpu-states", "tiers"], "tiers"),
    ([], "auto"),  # no ZenFlow: nothing to settle
])
def test_cpu_states_settled_by_the_run_config(flags, expected):
    assert parse_config([*MIN, *flags]).zenflow.zenflow_cpu_states == expected


def test_tiers_need_the_offload_optimizer():
    with pytest.raises(UsageError) as err:
        parse_config([*MIN, "--zenflow", "--zenflow-cpu-states", "tiers"])
    assert str(err.value) == ("--zenflow-cpu-states tiers keeps ZenFlow's CPU-side states in "
                              "the offload tiers: add --offload-optimizer (and --offload-paths)")
    with pytest.raises(UsageError, match="--zenflow-cpu-states needs --zenflow"):
        parse_config([*MIN, "--offload-optimizer", "--zenflow-cpu-states", "tiers"])
    with pytest.raises(UsageError, match="give auto, host or tiers"):
        ZenFlowConfig(zenflow=True, zenflow_cpu_states="disk")


def test_knobs_from_the_environment(monkeypatch):
    for name in ("CPUS", "THREADS", "STAGING_SLOTS", "DEVICE_FREE_BYTES", "JITTER"):
        monkeypatch.delenv(f"MEGATRON_EXT_ZENFLOW_{name}", raising=False)
    monkeypatch.delenv("MEGATRON_EXT_NO_HOST_KERNELS", raising=False)
    cfg = ZenFlowConfig()  # without --zenflow: knobs are no flags the user gave
    assert (cfg.zenflow_cpus, cfg.zenflow_threads, cfg.zenflow_staging_slots,
            cfg.zenflow_device_free_bytes, cfg.zenflow_jitter,
            cfg.zenflow_no_host_kernels) == ("", None, STAGING_SLOTS, None, 0.0, False)
    monkeypatch.setenv("MEGATRON_EXT_ZENFLOW_THREADS", "6")
    monkeypatch.setenv("MEGATRON_EXT_ZENFLOW_STAGING_SLOTS", "2")
    monkeypatch.setenv("MEGATRON_EXT_ZENFLOW_DEVICE_FREE_BYTES", "12345")
    monkeypatch.setenv("MEGATRON_EXT_ZENFLOW_JITTER", "0.25")
    monkeypatch.setenv("MEGATRON_EXT_ZENFLOW_CPUS", "all")
    monkeypatch.setenv("MEGATRON_EXT_NO_HOST_KERNELS", "1")
    cfg = ZenFlowConfig()
    assert (cfg.zenflow_cpus, cfg.zenflow_threads, cfg.zenflow_staging_slots,
            cfg.zenflow_device_free_bytes, cfg.zenflow_jitter,
            cfg.zenflow_no_host_kernels) == ("all", 6, 2, 12345, 0.25, True)
    monkeypatch.setenv("MEGATRON_EXT_NO_HOST_KERNELS", "0")
    assert ZenFlowConfig().zenflow_no_host_kernels is False


@pytest.mark.parametrize("name,value,message", [
    ("MEGATRON_EXT_ZENFLOW_THREADS", "0", "give a whole number of threads, at least 1"),
    ("MEGATRON_EXT_ZENFLOW_STAGING_SLOTS", "two", "give a whole number of slots, at least 1"),
    ("MEGATRON_EXT_ZENFLOW_DEVICE_FREE_BYTES", "1GB", "give a number of bytes"),
    ("MEGATRON_EXT_ZENFLOW_JITTER", "-1", "give a number of seconds >= 0"),
    ("MEGATRON_EXT_ZENFLOW_CPUS", "fast", "give CPU numbers and ranges, e.g. 2-15 or "
                                          "1,3,8-11, or all"),
    ("MEGATRON_EXT_ZENFLOW_CPUS", "0-4095", "are not available to this process"),
])
def test_knob_messages(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(UsageError) as err:
        ZenFlowConfig()
    assert str(err.value).startswith(f"{name}={value}: ") and message in str(err.value)


def test_the_builder_takes_settled_states_only():
    from megatron_ext.zenflow.optimizer import zenflow_optimizer

    with pytest.raises(ValueError, match="settles auto"):
        zenflow_optimizer(ZenFlowConfig(zenflow=True), rank=0)
