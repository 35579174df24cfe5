"""The Slurm job scripts of examples/slurm on a real Slurm cluster on localhost.

Every job trains the same tiny GPT (2 layers, hidden 64, mock data) with 2 processes on
the CPU (gloo), so the loss curve of each job must equal, bit for bit, that of one
uninterrupted run of smoke_local.sh (the same configuration without Slurm): exact resume
makes that hold also for the jobs that are interrupted, requeued and resumed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

from tests.slurm.cluster import SlurmCluster, free_ports

# With pytest -n (xdist), one worker runs them all: one Slurm cluster per session.
pytestmark = pytest.mark.xdist_group("slurm")

ROOT = Path(__file__).resolve().parents[2]
SLURM_DIR = ROOT / "examples" / "slurm"
SINGLE = SLURM_DIR / "pretrain_gpt.sbatch"
MULTI = SLURM_DIR / "pretrain_gpt_multinode.sbatch"
SMOKE = SLURM_DIR / "smoke_local.sh"
FINETUNE = SLURM_DIR / "finetune_zenflow.sbatch"

ITERS = 80
# The knobs of the job scripts for the tiny CPU configuration of tests/conftest.py (TINY).
TINY_KNOBS = {
    "NUM_LAYERS": "2", "HIDDEN_SIZE": "64", "NUM_ATTENTION_HEADS": "4", "SEQ_LENGTH": "32",
    "MICRO_BATCH_SIZE": "4", "VOCAB_SIZE": "250", "LR": "1e-2", "MIN_LR": "1e-4",
    "LR_WARMUP_ITERS": "2", "WEIGHT_DECAY": "0.01", "SEED": "1234", "PRECISION": "fp32",
    "LOG_INTERVAL": "1", "EVAL_ITERS": "0", "DEVICE": "cpu", "NPROC": "2",
    "TRAIN_ITERS": str(ITERS),
    # Only the end of training and the exit signal save a checkpoint.
    "SAVE_INTERVAL": "100000",
}
# A CPU cluster: the scripts ask for 8 GPUs per node.
NO_GPUS = ["--gpus-per-node=0"]


# Every knob of the scripts: none may leak in from the environment of the test run.
ALL_KNOBS = (
    "NUM_LAYERS", "HIDDEN_SIZE", "NUM_ATTENTION_HEADS", "SEQ_LENGTH", "TRAIN_ITERS",
    "MICRO_BATCH_SIZE", "GLOBAL_BATCH_SIZE", "LR", "MIN_LR", "LR_WARMUP_ITERS",
    "WEIGHT_DECAY", "SEED", "PRECISION", "DATA_PATH", "TOKENIZER_TYPE", "TOKENIZER_MODEL",
    "SPLIT", "VOCAB_SIZE", "RUN_DIR", "SAVE_DIR", "SAVE_INTERVAL", "LOG_INTERVAL",
    "EVAL_INTERVAL", "EVAL_ITERS", "METRICS_PATH", "WANDB_PROJECT", "WANDB_MODE", "TP", "PP",
    "NPROC", "DEVICE", "PYTHON", "MEGATRON_EXT_DIR", "EXTRA_ARGS", "SHUTDOWN_TIMEOUT",
    "MAX_REQUEUES", "MASTER_PORT", "PRETRAINED", "ZENFLOW_TOPK_RATIO",
    "ZENFLOW_UPDATE_INTERVAL", "ZENFLOW_SELECT_INTERVAL", "ZENFLOW_WARMUP_STEPS",
    "MAX_POSITION_EMBEDDINGS", "LR_DECAY_STYLE",
)


def job_env(run_dir: Path, **extra: str) -> Dict[str, str]:
    """The environment of a job (or of smoke_local.sh) in the tiny CPU configuration."""
    env = {k: v for k, v in os.environ.items()
           if k not in ALL_KNOBS and not k.startswith("SLURM_")
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(TINY_KNOBS)
    env.update({"RUN_DIR": str(run_dir), "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
                "MEGATRON_EXT_DIR": str(ROOT)})
    env.update(extra)
    return env


def multinode_env(run_dir: Path) -> Dict[str, str]:
    # A free rendezvous port rather than the script's 20000 + job id: another test session
    # on this machine has the same job ids.
    return job_env(run_dir, MASTER_PORT=str(free_ports(1)[0]))


def loss_curve(metrics: Path) -> Dict[int, float]:
    """lm loss by iteration; a later record of an iteration replaces an earlier one (a
    resumed run repeats the iterations after its checkpoint)."""
    curve: Dict[int, float] = {}
    with open(metrics) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                if "lm_loss" in record:
                    curve[record["iteration"]] = record["lm_loss"]
    return curve


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return f"({path} does not exist)"


def metrics_records(path: Path) -> int:
    try:
        with open(path) as f:
            return sum(1 for line in f if '"lm_loss"' in line)
    except FileNotFoundError:
        return 0


def wait_for_records(cluster: SlurmCluster, job: int, metrics: Path, count: int,
                     output: Path, timeout: float = 120) -> None:
    """Waits until the job has logged COUNT iterations (training is under way)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics_records(metrics) >= count:
            return
        state = cluster.job_state(job).get("JobState")
        if state != "RUNNING" and state != "PENDING":
            break
        time.sleep(0.05)
    pytest.fail(f"job {job} did not log {count} iterations (it logged "
                f"{metrics_records(metrics)})\n{cluster.diagnostics(job, output)}")


class Reference:
    """One uninterrupted run of smoke_local.sh (no Slurm), started in the background so
    that it overlaps the first job; :meth:`curve` waits for it."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.log = run_dir / "smoke_local.out"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(["bash", str(SMOKE)], cwd=ROOT, env=job_env(run_dir),
                                         stdout=out, stderr=subprocess.STDOUT)
        self._curve = None

    def curve(self) -> Dict[int, float]:
        if self._curve is None:
            try:
                rc = self.proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = self.proc.wait()
            text = read(self.log)
            assert rc == 0, f"smoke_local.sh exited {rc}:\n{text[-6000:]}"
            assert "megatron_ext: cpu x2 " in text, text[-3000:]
            curve = loss_curve(self.run_dir / "metrics.jsonl")
            assert sorted(curve) == list(range(1, ITERS + 1)), text[-3000:]
            self._curve = curve
        return self._curve


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory):
    ref = Reference(tmp_path_factory.mktemp("reference"))
    yield ref
    if ref.proc.poll() is None:
        ref.proc.kill()
        ref.proc.wait()


def check_finished(cluster: SlurmCluster, job: int, run_dir: Path, output: Path,
                   reference: Reference, restarts: int) -> str:
    """The job COMPLETED after RESTARTS requeues with the reference loss curve."""
    info = cluster.wait(job, {"COMPLETED"}, timeout=240, output=output)
    log = read(output)
    why = f"\n{cluster.diagnostics(job, output)}"
    assert info.get("Restarts") == str(restarts), f"Restarts={info.get('Restarts')}" + why
    assert "megatron_ext: cpu x2 " in log, why
    assert (run_dir / "checkpoints" / f"iter_{ITERS:07d}").is_dir(), why
    assert read(run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").strip() \
        == str(ITERS), why
    curve = loss_curve(run_dir / "metrics.jsonl")
    assert sorted(curve) == list(range(1, ITERS + 1)), f"iterations {sorted(curve)}" + why
    expected = reference.curve()
    diff = {it: (curve[it], expected[it]) for it in curve if curve[it] != expected[it]}
    assert not diff, f"loss differs from the uninterrupted run at {diff}" + why
    return log


def check_interrupted(log: str, run_dir: Path, interruptions: int, why: str) -> List[int]:
    """The log shows INTERRUPTIONS + 1 runs; each but the last stopped on a signal at a
    checkpoint strictly inside the training, which the next run loaded. Returns the
    iterations of those checkpoints."""
    runs = re.findall(r"run (\d+) \(SLURM_RESTART_COUNT=(\d+)\)", log)
    assert runs == [(str(n + 1), str(n)) for n in range(interruptions + 1)], f"runs {runs}" + why
    saved = [int(n) for n in re.findall(r"exit signal received: saving at iteration (\d+)", log)]
    assert len(saved) == interruptions, f"signal saves {saved}" + why
    assert 0 < saved[0] and saved == sorted(set(saved)) and saved[-1] < ITERS, \
        f"signal saves {saved}" + why
    for stop in saved:
        path = run_dir / "checkpoints" / f"iter_{stop:07d}"
        assert f"loaded {path} (iteration {stop}," in log, why
        assert path.is_dir(), why
    return saved


def submit(cluster: SlurmCluster, script: Path, run_dir: Path):
    """Submits SCRIPT in the tiny CPU configuration; returns (job id, its output file)."""
    if script == MULTI:
        env, args = multinode_env(run_dir), [*NO_GPUS, "--nodes=1"]
    else:
        env, args = job_env(run_dir), NO_GPUS
    job = cluster.sbatch(script, env=env, args=args, output=run_dir / "job-%j.out", chdir=ROOT)
    return job, run_dir / f"job-{job}.out"


def interrupt(cluster: SlurmCluster, job: int, how: str, run_dir: Path, output: Path,
              restarts: int) -> None:
    """Once the current run has trained 3 iterations, interrupts it HOW ('usr1': the
    warning signal to the batch shell, whose script requeues the job; 'requeue':
    `scontrol requeue`, i.e. SIGTERM to every process), then waits for the job to be
    pending again and starts it at once (Slurm would hold it back 2 minutes)."""
    metrics = run_dir / "metrics.jsonl"
    wait_for_records(cluster, job, metrics, metrics_records(metrics) + 3, output)
    if how == "usr1":
        cluster.signal(job, "USR1", batch=True)
    else:
        cluster.requeue(job)
    cluster.wait(job, {"PENDING"}, timeout=120, output=output,
                 predicate=lambda info: info.get("Restarts") == str(restarts))
    cluster.start_now(job)


def test_single_node_job_runs_to_completion(slurm_cluster, reference, tmp_path):
    job, output = submit(slurm_cluster, SINGLE, tmp_path)
    log = check_finished(slurm_cluster, job, tmp_path, output, reference, restarts=0)
    assert "SLURM_RESTART_COUNT=0" in log and "exit signal received" not in log, log[-3000:]


def test_multinode_job_runs_to_completion(slurm_cluster, reference, tmp_path):
    job, output = submit(slurm_cluster, MULTI, tmp_path)
    log = check_finished(slurm_cluster, job, tmp_path, output, reference, restarts=0)
    host = slurm_cluster.host
    assert f"rendezvous at {host}:" in log and "--rdzv_backend=c10d" in log, log[-3000:]


def test_single_node_job_saves_requeues_itself_on_usr1_and_resumes_exactly(
        slurm_cluster, reference, tmp_path):
    """SIGUSR1 to the batch shell (what --signal=B:USR1@120 sends before the time limit):
    the shell passes it to torchrun's workers, they save and exit, the script requeues
    the job, the next run resumes from the checkpoint."""
    job, output = submit(slurm_cluster, SINGLE, tmp_path)
    interrupt(slurm_cluster, job, "usr1", tmp_path, output, restarts=1)
    log = check_finished(slurm_cluster, job, tmp_path, output, reference, restarts=1)
    why = f"\n{slurm_cluster.diagnostics(job, output)}"
    check_interrupted(log, tmp_path, 1, why)
    assert log.count("received SIGUSR1") == 1 and log.count("requeueing job") == 1, why


def test_multinode_job_survives_scontrol_requeue_and_usr1_and_resumes_exactly(
        slurm_cluster, reference, tmp_path):
    """Run 1 ends by `scontrol requeue` (Slurm's SIGTERM reaches every process; Slurm
    requeues), run 2 by SIGUSR1 to the batch shell (passed on through srun and torchrun;
    the script requeues), run 3 finishes; each resumes from the previous checkpoint."""
    job, output = submit(slurm_cluster, MULTI, tmp_path)
    interrupt(slurm_cluster, job, "requeue", tmp_path, output, restarts=1)
    interrupt(slurm_cluster, job, "usr1", tmp_path, output, restarts=2)
    log = check_finished(slurm_cluster, job, tmp_path, output, reference, restarts=2)
    why = f"\n{slurm_cluster.diagnostics(job, output)}"
    check_interrupted(log, tmp_path, 2, why)
    assert log.count("received SIGTERM") == 1 and log.count("received SIGUSR1") == 1, why
    # Only the USR1 run requeues itself: after SIGTERM, Slurm does.
    assert log.count("requeueing job") == 1, why


def test_plain_srun_tasks_read_their_layout_from_slurm(slurm_cluster, tmp_path):
    """No torchrun: each srun task takes RANK/WORLD_SIZE/LOCAL_RANK from SLURM_PROCID,
    SLURM_NTASKS, SLURM_LOCALID and MASTER_ADDR from the node list."""
    from mext_testing import TINY

    metrics = tmp_path / "metrics.jsonl"
    script = tmp_path / "plain_srun.sbatch"
    args = " ".join([*TINY, "--train-iters", "12", "--use-distributed-optimizer",
                     "--metrics-path", str(metrics)])
    script.write_text("#!/bin/bash\n#SBATCH --ntasks=2\nset -euo pipefail\n"
                      f"srun --ntasks=2 {sys.executable} {ROOT / 'pretrain_gpt.py'} {args}\n")
    env = job_env(tmp_path, MASTER_PORT=str(free_ports(1)[0]))
    job = slurm_cluster.sbatch(script, env=env, args=NO_GPUS, output=tmp_path / "job-%j.out",
                               chdir=ROOT)
    output = tmp_path / f"job-{job}.out"
    slurm_cluster.wait(job, {"COMPLETED"}, timeout=180, output=output)
    log = read(output)
    assert "megatron_ext: cpu x2 " in log, slurm_cluster.diagnostics(job, output)
    curve = loss_curve(metrics)
    assert sorted(curve) == list(range(1, 13)), log[-3000:]
    assert curve[12] < curve[1], curve


# ---------------------------------------------------------------- finetune_zenflow.sbatch

FT_ITERS = 8
PRETRAIN_ITERS = 4


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A checkpoint of the tiny GPT after 4 iterations, saved by pretrain_gpt.py directly."""
    from mext_testing import TINY, run_pretrain

    ckpt = tmp_path_factory.mktemp("pretrained") / "checkpoints"
    run_pretrain([*TINY, "--use-distributed-optimizer", "--train-iters", str(PRETRAIN_ITERS),
                  "--save", str(ckpt)], timeout=180)
    assert read(ckpt / "latest_checkpointed_iteration.txt").strip() == str(PRETRAIN_ITERS)
    return ckpt


def finetune_env(run_dir: Path, pretrained: Path, **extra: str) -> Dict[str, str]:
    """The tiny CPU configuration of finetune_zenflow.sbatch: 2 processes (DP=2: the
    column selection all-reduces over both), windows of 2 steps, re-selection every 4."""
    knobs = {"PRETRAINED": str(pretrained), "NPROC": "2", "LR": "1e-3",
             "TRAIN_ITERS": str(FT_ITERS), "ZENFLOW_UPDATE_INTERVAL": "2",
             "ZENFLOW_SELECT_INTERVAL": "4", "METRICS_PATH": str(run_dir / "metrics.jsonl")}
    return job_env(run_dir, **{**knobs, **extra})


def run_finetune_job(cluster: SlurmCluster, env: Dict[str, str], run_dir: Path) -> str:
    """Submits finetune_zenflow.sbatch, waits until it COMPLETED; returns its output."""
    job = cluster.sbatch(FINETUNE, env=env, args=NO_GPUS, output=run_dir / "job-%j.out",
                         chdir=ROOT)
    output = run_dir / f"job-{job}.out"
    info = cluster.wait(job, {"COMPLETED"}, timeout=180, output=output)
    assert info.get("ExitCode") == "0:0", cluster.diagnostics(job, output)
    return read(output)


def train_records(metrics: Path) -> List[dict]:
    with open(metrics) as f:
        return [r for r in map(json.loads, filter(str.strip, f)) if "lm_loss" in r]


def test_finetune_zenflow_job_finetunes_from_pretrained_then_resumes_from_save_dir(
        slurm_cluster, pretrained, tmp_path):
    """Run 1 (SAVE_DIR empty) fine-tunes: --finetune --load PRETRAINED, iterations from 0,
    ZenFlow metrics in every record, a checkpoint with the ZenFlow state. Run 2, with the
    same SAVE_DIR (what a requeued run finds), resumes from it without --finetune."""
    save = tmp_path / "checkpoints"
    metrics = tmp_path / "metrics.jsonl"
    log = run_finetune_job(slurm_cluster, finetune_env(tmp_path, pretrained), tmp_path)
    why = f"\n{log[-4000:]}"
    assert f"fine-tuning from {pretrained} (iteration {PRETRAIN_ITERS})" in log, why
    assert f"--finetune --load {pretrained} " in log and " --zenflow " in log, why
    assert f"loaded {pretrained}/iter_{PRETRAIN_ITERS:07d} (iteration 0," in log, why
    assert "megatron_ext: cpu x2 (TP=1 PP=1 DP=2)" in log, why
    records = train_records(metrics)
    assert [r["iteration"] for r in records] == list(range(1, FT_ITERS + 1)), why
    for r in records:
        assert 0 <= r["zenflow/rho"] <= 1 and 0 < r["zenflow/selected_ratio"] <= 1, r
        assert r["zenflow/update_interval"] == 2, r
    assert read(save / "latest_checkpointed_iteration.txt").strip() == str(FT_ITERS), why
    for rank in (0, 1):
        assert (save / f"iter_{FT_ITERS:07d}" / "zenflow" / f"rank{rank:05d}.pt").is_file(), why
    # The pretrained checkpoint is only read.
    assert sorted(p.name for p in pretrained.iterdir()) == \
        [f"iter_{PRETRAIN_ITERS:07d}", "latest_checkpointed_iteration.txt"]

    # A longer run than the checkpoint's schedule: Megatron-LM refuses that unless told which
    # schedule to keep, and so does this project (--override-opt_param-scheduler: the flags').
    log = run_finetune_job(slurm_cluster, finetune_env(
        tmp_path, pretrained, TRAIN_ITERS=str(FT_ITERS + 4),
        EXTRA_ARGS="--override-opt_param-scheduler"), tmp_path)
    why = f"\n{log[-4000:]}"
    assert f"resuming the fine-tune from {save} (iteration {FT_ITERS})" in log, why
    assert "--finetune" not in log and f"--load {save} " in log, why
    assert f"loaded {save}/iter_{FT_ITERS:07d} (iteration {FT_ITERS}," in log, why
    records = train_records(metrics)
    assert [r["iteration"] for r in records] == list(range(1, FT_ITERS + 5)), why
    assert all("zenflow/rho" in r for r in records), why
    assert (save / f"iter_{FT_ITERS + 4:07d}" / "zenflow").is_dir(), why


@pytest.mark.parametrize("case", ["unset", "not_a_checkpoint"])
def test_finetune_zenflow_refuses_a_missing_pretrained_checkpoint(case, tmp_path):
    """No Slurm needed: the script runs under bash; it stops before training with one
    error line that names PRETRAINED."""
    env = job_env(tmp_path)
    if case == "not_a_checkpoint":
        env["PRETRAINED"] = str(tmp_path)
    result = subprocess.run(["bash", str(FINETUNE)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "error: PRETRAINED" in lines[0], result.stderr
    assert not (tmp_path / "checkpoints").exists(), "it went on after the error"


OUTSIDE_SLURM = {
    "pretrain_gpt.sbatch": "bash examples/slurm/smoke_local.sh",
    "finetune_zenflow.sbatch": "DEVICE=cpu",
    "pretrain_gpt_multinode.sbatch": "smoke_local.sh",
}


@pytest.mark.parametrize("script", sorted(OUTSIDE_SLURM))
def test_job_script_outside_slurm_without_gpu_says_what_to_do(script, tmp_path):
    """No Slurm needed: plain bash, no SLURM_* variables, the default DEVICE (cuda) on a
    machine without a GPU. One line says what to do; no training process starts."""
    if list(Path("/dev").glob("nvidia[0-9]*")):
        pytest.skip("this machine has a GPU: the scripts run under plain bash there")
    env = job_env(tmp_path)
    del env["DEVICE"], env["NPROC"]
    env["PRETRAINED"] = str(tmp_path)  # past finetune_zenflow's own check, if it came first
    result = subprocess.run(["bash", str(SLURM_DIR / script)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "error: " in lines[0] and OUTSIDE_SLURM[script] in lines[0], lines[0]
    assert "torch.distributed.run" not in result.stdout, "it started the training processes"
    assert not (tmp_path / "checkpoints").exists()
