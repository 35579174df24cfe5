"""wandb offline: a tiny real run's wandb files hold its config and every JSONL value.

The run is read back with wandb's own reader of the transaction log, `wandb leet inspect`
(wandb 0.31.0 no longer ships the Python DataStore reader). wandb stores each history
value as JSON text, and a float as the shortest text that reads back as the same
float64, so the values are compared exactly; the test checks that float32 rounding
would have been caught.
"""

from __future__ import annotations

import glob
import json
import math
import os
import struct
import subprocess
import sys

from megatron_ext.config import parse_config
from mext_testing import TINY, read_metrics, run_pretrain

# Any network request would go here and fail at once: port 9 (discard) on the loopback
# interface has no listener.
UNREACHABLE = "http://127.0.0.1:9"


def wandb_leet(*args: str) -> str:
    """Runs `wandb leet inspect ARGS` (wandb's reader of a run's .wandb log)."""
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def same(a, b) -> bool:
    """Equal, exactly (NaN equals NaN); wandb writes 1.0 as 1, which compares equal."""
    nan = lambda x: isinstance(x, float) and math.isnan(x)  # noqa: E731
    return a == b or (nan(a) and nan(b))


def test_offline_run_holds_config_and_every_metric(tmp_path, monkeypatch):
    # No credentials, no server, no proxy that could make a request succeed, and no
    # settings from the user's ~/.config/wandb.
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert "WANDB_API_KEY" not in os.environ  # run_pretrain's child env starts from it
    env = {"WANDB_MODE": "offline", "WANDB_BASE_URL": UNREACHABLE,
           "HTTP_PROXY": UNREACHABLE, "HTTPS_PROXY": UNREACHABLE,
           "http_proxy": UNREACHABLE, "https_proxy": UNREACHABLE,
           "WANDB_CONFIG_DIR": str(tmp_path / "config"),
           "WANDB_CACHE_DIR": str(tmp_path / "cache"), "WANDB_DATA_DIR": str(tmp_path / "data")}
    save_dir, metrics = tmp_path / "wb", tmp_path / "m.jsonl"
    args = [*TINY, "--train-iters", "8", "--eval-iters", "2", "--eval-interval", "4",
            "--wandb-project", "p", "--wandb-exp-name", "e", "--wandb-save-dir", str(save_dir),
            "--wandb-mode", "offline", "--metrics-path", str(metrics)]
    run_pretrain(args, env=env, timeout=120)  # a network retry loop would take 90 s+

    runs = glob.glob(str(save_dir / "wandb" / "*run-*"))
    assert len(runs) == 1 and os.path.basename(runs[0]).startswith("offline-run-"), runs
    (log_file,) = glob.glob(os.path.join(runs[0], "run-*.wandb"))
    # A request to the server would have failed and been logged with its address.
    for path in glob.glob(os.path.join(runs[0], "logs", "*")):
        with open(path, errors="replace") as f:
            assert "127.0.0.1:9" not in f.read(), path

    summary = json.loads(wandb_leet("--summary", "--json", log_file))
    assert summary["state"] == "finished" and summary["exit_code"] == 0
    assert (summary["project"], summary["name"]) == ("p", "e")
    config = summary["config"]
    assert config["model"]["num_layers"] == 2
    assert config["training"]["train_iters"] == 8
    expected = parse_config(args).to_dict()
    expected["training"]["global_batch_size"] = 4  # micro batch 4 x DP 1, set at startup
    assert {k: v for k, v in config.items() if k != "_wandb"} == expected

    records = [json.loads(line) for line in wandb_leet("--json", log_file).splitlines()]
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["telemetry"]["feature"]["offline"] is True
    history = {}
    for r in records:
        if r["type"] == "history":
            item = r["history"]["item"]
            assert item["_step"] == r["history"]["step"]["num"]
            assert item["_step"] not in history
            history[item["_step"]] = item

    logged = read_metrics(metrics)
    # Training records at 1..8 and evaluations at 4 and 8, merged into those steps.
    assert sorted(history) == list(range(1, 9))
    assert [r["iteration"] for r in logged if "eval/lm_loss" in r] == [4, 8]
    floats = []
    for record in logged:
        item = history[record["iteration"]]
        for key, value in record.items():
            if key == "iteration":
                continue
            assert key in item, (record["iteration"], key)
            assert same(item[key], value), (record["iteration"], key, item[key], value)
            if isinstance(value, float):
                floats.append(value)
    # Exact equality is a real test of float64 storage: most values are not float32s.
    assert sum(v != float32(v) for v in floats) > len(floats) // 2
    extra = {k for item in history.values() for k in item if not k.startswith("_")} - \
        {k for r in logged for k in r}
    assert not extra, extra
