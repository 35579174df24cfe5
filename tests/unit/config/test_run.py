"""RunConfig as a whole: what it records of a run survives the trip through JSON."""

import json

from megatron_ext.config import parse_config

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "4",
         "--lr", "1e-3", "--train-iters", "8", "--mock-data", "--vocab-size", "100"]


def test_the_config_and_its_knobs_survive_json(monkeypatch):
    """wandb and the metrics keep the config as JSON: every value, the knobs' too, must come
    back equal (a tuple would come back a list)."""
    for name, value in {"MEGATRON_EXT_DEVICE_PEAK_GB": "1:0.5,6:0.8",
                        "MEGATRON_EXT_CHECKPOINT_FAULT": "enospc:4",
                        "MEGATRON_EXT_OFFLOAD_FAULT": "slow:0:10:1;vanish:1:4",
                        "MEGATRON_EXT_ZENFLOW_CPUS": "0-1"}.items():
        monkeypatch.setenv(name, value)
    for flags in (FLAGS, [*FLAGS, "--use-distributed-optimizer", "--zenflow"]):
        config = parse_config(flags).to_dict()
        assert json.loads(json.dumps(config)) == config
        assert config["offload"]["offload_device_peak_gb"] == [[1, 0.5], [6, 0.8]]
        assert config["faults"]["offload_fault"] == [["slow", "0", "10", "1"], ["vanish", "1", "4"]]
