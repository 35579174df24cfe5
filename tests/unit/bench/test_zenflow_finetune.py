"""bench/gpu/zenflow_finetune.py and bench/peers/ds_finetune.py: curves, summary, data split,
schedule.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "gpu"))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "peers"))

import ds_finetune  # noqa: E402
import zenflow_finetune as zf  # noqa: E402


def _records(losses, evals, step_s=0.5, rho=None):
    out = []
    for i, loss in enumerate(losses, start=1):
        r = {"iteration": i, "lm_loss": loss, "time/iteration_s": step_s}
        if rho is not None:
            r["zenflow/rho"] = rho
            r["zenflow/retention"] = float("nan") if i < 3 else 0.5
        out.append(r)
        if i in evals:
            out.append({"iteration": i, "eval/lm_loss": evals[i]})
    return out


def test_curves_put_evaluations_on_the_training_wall_time():
    c = zf.curves(_records([3.0, 2.9, 2.8, 2.7], {2: 2.95, 4: 2.75}, step_s=0.25, rho=0.6))
    assert c["iteration"] == [1, 2, 3, 4]
    assert c["eval_iteration"] == [2, 4] and c["eval_loss"] == [2.95, 2.75]
    assert c["eval_wall_s"] == [0.5, 1.0]
    assert c["rho"] == [0.6] * 4 and math.isnan(c["retention"][0])
    assert "rho" not in zf.curves(_records([3.0], {1: 3.0}))


def _run(row, seed, final, step_s=0.5, rho=None):
    return {"row": row, "seed": seed, "returncode": 0,
            "curves": zf.curves(_records([3.0] * 6, {6: final}, step_s=step_s, rho=rho))}


def test_summary_pairs_each_zenflow_with_its_own_frameworks_adam_by_seed():
    runs = [_run("adam", 1, 2.00), _run("adam", 2, 2.10), _run("zenflow", 1, 2.05, 0.6, 0.7),
            _run("zenflow", 2, 2.25, 0.6, 0.5), _run("ds-adam", 1, 3.0, 1.0),
            _run("ds-zenflow", 1, 3.5, 2.0), _run("ds-zenflow", 2, 3.9, 2.0)]
    runs.append({"row": "zenflow-auto", "seed": 1, "returncode": 1, "curves": {}})
    runs.append({"row": "zenflow-auto", "seed": 2, "returncode": None, "skipped": True,
                 "curves": {}})
    table = {e["row"]: e for e in zf.summarize(runs)}
    assert list(table) == ["adam", "zenflow", "zenflow-auto", "ds-adam", "ds-zenflow"]
    z = table["zenflow"]
    assert z["final_val_loss"]["mean"] == pytest.approx(2.15)
    assert z["gap_to_adam"]["n"] == 2
    assert z["gap_to_adam"]["mean"] == pytest.approx(0.10)  # (0.05 + 0.15) / 2
    assert (z["gap_to_adam"]["min"], z["gap_to_adam"]["max"]) == pytest.approx((0.05, 0.15))
    assert z["adam_spread"] == pytest.approx(0.10)
    assert z["step_vs_adam"] == pytest.approx(1.2)
    assert z["rho_mean"] == pytest.approx(0.6) and z["retention_mean"] == pytest.approx(0.5)
    assert table["adam"]["gap_to_adam"] is None and table["adam"]["step0_val_loss"] is None
    # DeepSpeed's ZenFlow against DeepSpeed's Adam, seed 2 has no Adam to pair with.
    ds = table["ds-zenflow"]
    assert ds["gap_to_adam"]["n"] == 1 and ds["gap_to_adam"]["mean"] == pytest.approx(0.5)
    assert ds["step_vs_adam"] == pytest.approx(2.0)
    assert table["zenflow-auto"]["failed"] == [1] and table["zenflow-auto"]["skipped"] == [2]
    text = zf.markdown(zf.summarize(runs))
    assert "| zenflow | 2 | 2.1500 |" in text and "+0.1000 (+0.0500, +0.1500)" in text
    assert "| zenflow-auto | 0 (1 failed) (1 skipped) |" in text


def test_step0_loss_is_reported_where_a_row_evaluated_before_training():
    run = _run("ds-zenflow", 1, 3.0)
    run["curves"]["eval_iteration"].insert(0, 0)
    run["curves"]["eval_loss"].insert(0, 5.5)
    entry = zf.summarize([run])[0]
    assert entry["step0_val_loss"] == 5.5 and entry["final_val_loss"]["mean"] == 3.0
    assert zf.markdown([entry]).rstrip().endswith("| 5.5000 |")


def test_report_writes_the_files_and_plot_only_redraws_them(tmp_path):
    runs = [_run("adam", 1, 2.0), _run("zenflow", 1, 2.1, rho=0.6)]
    a = zf.parse(["--tiny", "--output-dir", str(tmp_path)])
    zf.report(runs, a, tmp_path)
    saved = json.loads((tmp_path / "runs.json").read_text())
    assert [r["row"] for r in saved["runs"]] == ["adam", "zenflow"]
    assert saved["summary"][1]["gap_to_adam"]["mean"] == pytest.approx(0.1)
    lines = (tmp_path / "summary.csv").read_text().splitlines()
    assert lines[0].startswith("row,framework,n,mean") and lines[2].startswith("zenflow,")
    (tmp_path / "summary.md").unlink()
    assert zf.main(["--plot-only", "--output-dir", str(tmp_path)]) == 0
    assert (tmp_path / "summary.md").read_text() == zf.markdown(zf.summarize(runs))


def test_rows_and_defaults():
    a = zf.parse(["--output-dir", "x"])
    assert (a.device, a.seeds, a.pretrain_iters, a.finetune_iters) == ("cuda", [1, 2, 3], 150, 100)
    assert a.shape["hidden"] == 2048 and a.shape["vocab"] >= 257
    paper = zf.finetune_args(a, "zenflow-paper", 2)
    assert paper[paper.index("--zenflow-topk-ratio") + 1] == "0.05"
    assert paper[paper.index("--zenflow-select-interval") + 1] == "100"
    assert "--zenflow" not in zf.finetune_args(a, "adam", 1)
    small = zf.parse(["--output-dir", "x", "--tiny", "--shape", "layers=4,hidden=256"])
    assert (small.shape["layers"], small.shape["hidden"], small.shape["seq"]) == (4, 256, 64)
    with pytest.raises(SystemExit):
        zf.parse(["--output-dir", "x", "--shape", "depth=4"])


def test_byte_ids_are_the_utf8_bytes(tmp_path):
    src, dst = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    src.write_text(json.dumps({"text": "hé"}) + "\n" + json.dumps({"text": ""}) + "\n")
    assert zf.to_byte_ids(src, dst) == 1
    assert json.loads(dst.read_text())["text"] == "104 195 169"


def test_ds_split_is_megatrons_document_ranges():
    assert ds_finetune.split_range(20, "85,15,0", 0) == range(0, 17)
    assert ds_finetune.split_range(20, "85,15,0", 1) == range(17, 20)
    assert ds_finetune.split_range(7, "98,2,0", 1) == range(7, 7)


def test_ds_batches_cover_the_training_documents_and_follow_the_seed():
    docs = [np.arange(10 * i, 10 * i + 10) for i in range(6)]
    one = ds_finetune.Batches(docs, range(0, 4), seq=4, micro_batch=2, seed=1)
    first = [one.next() for _ in range(4)]  # 40 tokens -> 8 rows of 5 -> 4 batches
    assert all(b.shape == (2, 5) for b in first)
    assert sorted(np.concatenate(first).ravel().tolist()) == list(range(40))
    again = ds_finetune.Batches(docs, range(0, 4), seq=4, micro_batch=2, seed=1)
    assert np.array_equal(again.next(), first[0])
    other = ds_finetune.Batches(docs, range(0, 4), seq=4, micro_batch=2, seed=2)
    assert not np.array_equal(other.next(), first[0])


def test_ds_schedule_warms_up_then_decays_to_a_tenth():
    assert ds_finetune.lr_at(1, 100, 1e-4) == pytest.approx(1e-5)
    assert ds_finetune.lr_at(10, 100, 1e-4) == pytest.approx(1e-4)
    assert ds_finetune.lr_at(100, 100, 1e-4) == pytest.approx(1e-5)
    assert ds_finetune.lr_at(55, 100, 1e-4) == pytest.approx(5.5e-5)
