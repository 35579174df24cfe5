"""examples/quickstart.sh runs end to end (12 iterations, 300 documents) inside the test venv,
then again with a larger QUICKSTART_ITERS, which trains on from the checkpoint.

The test's Python already has the pinned requirements, so the script must use it as it
is: no .venv created or activated, nothing installed (no network needed).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import matplotlib.image
import pytest

from mext_testing import ROOT, read_metrics

ITERS = 12  # the script logs every 10 iterations and at the end: records at 10 and 12
MORE_ITERS = 14  # the second run: QUICKSTART_ITERS raised after the first one
PROMPT = "import os\nimport sys\n\n\ndef main():\n"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_quickstart_end_to_end(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    work = tmp_path / "qs"
    env = {**os.environ, "PYTHON": sys.executable, "QUICKSTART_DIR": str(work),
           "QUICKSTART_ITERS": str(ITERS), "QUICKSTART_DOCS": "300", "WANDB_MODE": "offline",
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "PYTHONUNBUFFERED": "1",
           "HF_HUB_OFFLINE": "1"}
    out = _quickstart(env, tmp_path)
    assert "already has the requirements" in out, out[:2000]
    assert "pip install" not in out and "environment (.venv)" not in out
    assert re.search(r"^== \[\d+:\d\d\] done$", out, re.M), out[-2000:]

    ckpt = work / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    iter_dir = ckpt / f"iter_{ITERS:07d}"
    assert iter_dir.is_dir() and any(iter_dir.iterdir())

    records = read_metrics(work / "metrics.jsonl")
    assert [r["iteration"] for r in records if "lm_loss" in r] == [10, ITERS]
    assert [r["iteration"] for r in records if "eval/lm_loss" in r] == [ITERS]
    assert all(r["time/forward_s"] > 0 for r in records if "lm_loss" in r)

    (run,) = glob.glob(str(work / "wandb" / "offline-run-*"))
    assert glob.glob(os.path.join(run, "run-*.wandb"))

    png = work / "breakdown.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 20_000
    # The optimizer states were offloaded: half of the 6 subgroups went through the path.
    last = [r for r in records if "lm_loss" in r][-1]
    assert last["offload/device_state_gib"] == 0 and last["offload/io_bytes"] > 0
    assert (ckpt / f"iter_{ITERS:07d}" / "offload" / "rank00000" / "manifest.json").is_file()
    assert not list((work / "offload").rglob("sg*")), "tier files left after the run"
    height, width = matplotlib.image.imread(png).shape[:2]
    # The 4 core panels (time, loss, throughput, memory); the offload engine's 9 come with
    # tools/plot_breakdown.py --panels all, as the figure's bottom line says.
    assert (width, height) == (1210, round((0.8 + 2.4 * 4) * 110))
    assert "offload fields: 9 more panels with --panels all" in out
    assert f"plot: {work}/breakdown.png" in out

    # It sampled from the model it trained: the prompt, then text with letters (after 12
    # iterations hardly words, but not the "1" and blank lines that greedy decoding after a
    # prompt ending in a space gave), and exported the model for transformers.
    sample = (work / "sample.txt").read_text()
    assert sample.startswith(PROMPT) and sample.endswith("\n"), sample
    assert re.search(r"[A-Za-z]", sample[len(PROMPT):]), sample
    assert "sampling from the trained model" in out
    hf_dir = work / "hf"
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 4096
    assert (hf_dir / "tokenizer.model").read_bytes() == (work / "tokenizer.model").read_bytes()
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True)
    assert model.config.num_hidden_layers == 4
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    assert tokenizer.decode(tokenizer("def main():")["input_ids"]) == "def main():"

    # Raising QUICKSTART_ITERS trains on from the checkpoint to the new count (the learning
    # rate schedule of the new length), reusing the corpus, tokenizer and data.
    corpus_mtime = (work / "corpus.jsonl").stat().st_mtime_ns
    out = _quickstart({**env, "QUICKSTART_ITERS": str(MORE_ITERS)}, tmp_path)
    assert f"training from iteration {ITERS + 1}" in out, out[-6000:]
    assert (work / "corpus.jsonl").stat().st_mtime_ns == corpus_mtime
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(MORE_ITERS)
    records = read_metrics(work / "metrics.jsonl")
    assert [r["iteration"] for r in records if "lm_loss" in r] == [10, ITERS, MORE_ITERS]
    # Still in the 15 warm-up iterations: the schedule goes on where it was.
    last = [r for r in records if "lm_loss" in r][-1]
    assert last["lr"] == pytest.approx(2e-3 * MORE_ITERS / 15)

def _quickstart(env: dict, cwd) -> str:
    """Runs examples/quickstart.sh; its output (stdout and stderr)."""
    proc = subprocess.run(["bash", str(ROOT / "examples" / "quickstart.sh")], cwd=cwd,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout
