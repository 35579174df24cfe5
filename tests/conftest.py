"""Shared helpers of the test suite: run pretrain_gpt.py as real processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRETRAIN = str(ROOT / "pretrain_gpt.py")

# A tiny GPT on megatron-core's mock data: 2 layers, hidden 64, sequence 32.
TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "4", "--mock-data", "--vocab-size", "250",
    "--lr", "1e-2", "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--log-interval", "1",
    "--eval-iters", "0", "--device", "cpu", "--wandb-mode", "disabled", "--seed", "1234",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update({"PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": path})
    env.pop("RANK", None)
    env.update(extra or {})
    return env


def launch(args: Sequence[str], nproc: int = 1, env: Optional[dict] = None,
           **popen_kwargs) -> subprocess.Popen:
    """Starts pretrain_gpt.py (through torchrun when nproc > 1)."""
    if nproc == 1:
        cmd = [sys.executable, PRETRAIN, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), PRETRAIN, *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=test_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen_kwargs)


def run_pretrain(args: Sequence[str], nproc: int = 1, env: Optional[dict] = None,
                 timeout: int = 300, check: bool = True) -> subprocess.CompletedProcess:
    proc = launch(args, nproc=nproc, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"pretrain_gpt.py timed out after {timeout} s:\n{out[-4000:]}")
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, None)
    if check and proc.returncode != 0:
        raise AssertionError(f"pretrain_gpt.py exited {proc.returncode}:\n{out[-6000:]}")
    return result


def read_metrics(path) -> List[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_losses(path) -> List[float]:
    """lm loss of each logged training iteration (log interval 1), in order."""
    return [r["lm_loss"] for r in read_metrics(path) if "lm_loss" in r]


@pytest.fixture
def tiny_args():
    return list(TINY)
