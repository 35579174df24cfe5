"""The iteration line's ETA and optimizer sections, and the start-up checkpoint size (pure)."""

from __future__ import annotations

import pytest

from megatron_ext.training.metrics import EtaClock, dir_size_text, eta_text, format_line

RECORD = {"iteration": 10, "consumed_samples": 40, "time/iteration_s": 0.05, "lr": 1e-3,
          "global_batch_size": 4, "lm_loss": 5.0, "loss_scale": 1.0, "grad_norm": 1.0,
          "skipped_iterations": 0, "throughput/tokens_per_s": 100.0,
          "throughput/tflops_per_gpu": 0.0, "time/forward_s": 0.01}


@pytest.mark.parametrize("seconds,text", [
    (0, "00:00:00"), (59.6, "00:01:00"), (3661, "01:01:01"), (100 * 3600 + 5, "100:00:05"),
    (-3, "00:00:00"),
])
def test_eta_text(seconds, text):
    assert eta_text(seconds) == text


def test_eta_is_the_mean_iteration_time_so_far_times_what_is_left():
    clock = EtaClock(train_iters=100)
    assert clock.add(10, 20.0, 10) == pytest.approx(2.0 * 90)  # 2 s per iteration
    assert clock.add(10, 0.0, 20) == pytest.approx(1.0 * 80)   # mean over 20: 1 s
    assert clock.add(80, 80.0, 100) == 0.0


def test_eta_comes_last_after_the_existing_fields():
    line = format_line({**RECORD, "time/eta_s": 3725.0}, 100)
    assert line.endswith(" | ETA 01:02:05 |"), line
    without = format_line(RECORD, 100)
    assert line.startswith(without[:-1]), "the fields before the ETA changed"
    assert "ETA" not in without


def test_optimizer_section_comes_from_its_metrics():
    line = format_line({**RECORD, "zenflow/rho": 0.4567, "zenflow/update_interval": 4.0,
                        "zenflow/stall_s": 0.0012, "zenflow/selected_ratio": 0.1,
                        "time/eta_s": 1.0}, 100)
    assert "| zenflow: rho 0.457 S 4 stall (ms) 1.2 selected 10.0% | ETA 00:00:01 |" in line
    assert "zenflow" not in format_line(RECORD, 100)


def test_checkpoint_size_text(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(b"\0" * 2_500_000)
    (tmp_path / "y").write_bytes(b"\0" * 100_000)
    assert dir_size_text(str(tmp_path)) == "2.6 MB"
    (tmp_path / "big").write_bytes(b"")
    with open(tmp_path / "big", "wb") as f:
        f.truncate(1_500_000_000)  # sparse: size counts, not blocks
    assert dir_size_text(str(tmp_path)) == "1.50 GB"
