"""The iteration breakdown: one record per logged iteration, to stdout, JSONL and wandb.

Only rank 0 writes. Names carry their units (``time/forward_s``, ``memory/gpu_max_allocated_gib``).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import string
import time
from typing import Optional

import psutil
import torch

from megatron_ext.optim.modes import log_summaries

GIB = 1024**3
WANDB_ID_FILE = "wandb_run_id.txt"


def num_parameters(cfg, vocab_size: int) -> int:
    """Parameters of the whole model (all TP/PP ranks), from the config."""
    m = cfg.model
    h, ffn = m.hidden_size, m.ffn_hidden_size
    heads = m.num_attention_heads
    head_dim = m.kv_channels or h // heads
    groups = m.num_query_groups if m.group_query_attention else heads
    bias = 0 if m.disable_bias_linear else 1
    qkv_bias = 1 if bias or getattr(m, "add_qkv_bias", False) else 0
    per_norm = 2 if m.normalization == "LayerNorm" else 1
    norm = h * per_norm
    qkv_out = (heads + 2 * groups) * head_dim
    attention = h * qkv_out + qkv_bias * qkv_out + heads * head_dim * h + bias * h
    if getattr(m, "qk_layernorm", False):
        attention += 2 * head_dim * per_norm
    fc1_out = ffn * (2 if m.swiglu else 1)
    mlp = h * fc1_out + bias * fc1_out + ffn * h + bias * h
    layer = attention + mlp + 2 * norm
    embedding = vocab_size * h
    if m.position_embedding_type == "learned_absolute":
        embedding += m.max_position_embeddings * h
    output = vocab_size * h if m.untie_embeddings_and_output_weights else 0
    return embedding + m.num_layers * layer + norm + output


class MetricsWriter:
    """Writes the breakdown records (rank 0 only; other ranks hold a disabled writer)."""

    def __init__(self, cfg, enabled: bool):
        self.enabled = enabled
        self.cfg = cfg
        self._jsonl = None
        self._wandb = None
        if not enabled:
            return
        path = cfg.logging.metrics_path
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._jsonl = open(path, "a", buffering=1)
        self._init_wandb()

    def _init_wandb(self) -> None:
        lg = self.cfg.logging
        if lg.wandb_mode == "disabled" or not lg.wandb_project:
            return
        import wandb

        save_dir = lg.wandb_save_dir or (os.path.join(self.cfg.checkpoint.save, "wandb")
                                         if self.cfg.checkpoint.save else "wandb")
        os.makedirs(save_dir, exist_ok=True)
        self._wandb = wandb.init(project=lg.wandb_project, name=lg.wandb_exp_name,
                                 dir=save_dir, mode=lg.wandb_mode, config=self.cfg.to_dict(),
                                 **self._resume_args())

    def _resume_args(self) -> dict:
        """The wandb run id kept in --save, and resume="allow".

        A resumed or re-run job thus continues its wandb run instead of opening a new one.
        """
        save = self.cfg.checkpoint.save
        if not save:
            return {}
        path = os.path.join(save, WANDB_ID_FILE)
        run_id = None
        if os.path.isfile(path):
            with open(path, "rb") as f:
                text = f.read(128).decode("ascii", errors="replace").strip()
            run_id = text if text and text.replace("-", "").replace("_", "").isalnum() else None
        if run_id is None:
            # wandb's own id alphabet: lowercase letters and digits.
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits)
                             for _ in range(8))
            os.makedirs(save, exist_ok=True)
            tmp = f"{path}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(run_id + "\n")
            os.replace(tmp, path)
        return {"id": run_id, "resume": "allow"}

    def write(self, record: dict) -> None:
        """Writes one record to the JSONL file and wandb (not to stdout)."""
        if not self.enabled:
            return
        if self._jsonl:
            self._jsonl.write(json.dumps(record, sort_keys=True) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "iteration"},
                            step=record["iteration"])

    def close(self) -> None:
        """Closes the JSONL file and finishes the wandb run."""
        if self._jsonl:
            self._jsonl.close()
            self._jsonl = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def format_line(record: dict, train_iters: int, throughput: bool = True) -> str:
    """The Megatron-style stdout line of a training record.

    ``throughput`` (--log-throughput) adds the TFLOP/s per GPU, as Megatron-LM's line does
    with that flag; the parameters norm and the zeros in the gradients come when the record
    has them (--log-params-norm, --log-num-zeros-in-grad).
    """
    def fmt(key, spec):
        value = record.get(key)
        return "nan" if value is None or (isinstance(value, float) and math.isnan(value)) \
            else format(value, spec)

    parts = [
        f" iteration {record['iteration']:8d}/{train_iters:8d}",
        f"consumed samples: {record['consumed_samples']:12d}",
        f"elapsed time per iteration (ms): {record['time/iteration_s'] * 1000:.1f}",
        f"learning rate: {fmt('lr', '.6E')}",
        f"global batch size: {record['global_batch_size']:5d}",
        f"lm loss: {fmt('lm_loss', '.6E')}",
        f"loss scale: {fmt('loss_scale', '.1f')}",
        f"grad norm: {fmt('grad_norm', '.3f')}",
    ]
    if "num_zeros_in_grad" in record:
        parts.append(f"num zeros: {fmt('num_zeros_in_grad', '.0f')}")
    if "params_norm" in record:
        parts.append(f"params norm: {fmt('params_norm', '.3f')}")
    parts += [
        f"number of skipped iterations: {record['skipped_iterations']:3d}",
        f"tokens/s: {record['throughput/tokens_per_s']:.0f}",
    ]
    if throughput:
        parts.append(f"throughput per GPU (TFLOP/s/GPU, 6N): "
                     f"{record['throughput/tflops_per_gpu']:.1f}")
    breakdown = " ".join(f"{k.split('/')[1][:-2]} {record[k] * 1000:.1f}"
                         for k in ("time/forward_s", "time/backward_s", "time/grad_sync_s",
                                   "time/optimizer_s") if k in record)
    parts.append(f"breakdown (ms): {breakdown}")
    # Each optimizer mode's part (from its own metrics in the record, e.g. ``zenflow/*``).
    parts += log_summaries(record)
    if record.get("time/eta_s") is not None:
        parts.append(f"ETA {eta_text(record['time/eta_s'])}")
    return " | ".join(parts) + " |"


def eta_text(seconds: float) -> str:
    """``hh:mm:ss`` (hours past 99 as they are)."""
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class EtaClock:
    """Time left to --train-iters from the mean iteration time of this run so far.

    Evaluation and checkpoint time are not iterations (the loop times them apart); the
    first iterations' warm-up is in the mean, so early estimates run high.
    """

    def __init__(self, train_iters: int):
        self.train_iters = train_iters
        self.iterations = 0
        self.seconds = 0.0

    def add(self, iterations: int, seconds: float, iteration: int) -> float:
        """Counts ``iterations`` more, taking ``seconds``.

        Returns:
            the estimated seconds left after ``iteration``.
        """
        self.iterations += iterations
        self.seconds += seconds
        mean = self.seconds / max(1, self.iterations)
        return mean * max(0, self.train_iters - iteration)


def dir_size_text(path: str) -> str:
    """The bytes of the files under ``path``, in words (for start-up log lines)."""
    total = 0
    for directory, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except OSError:
                continue
    return f"{total / 1e9:.2f} GB" if total >= 1e8 else f"{total / 1e6:.1f} MB"


def memory_stats(runtime) -> dict:
    """Host resident memory and, on GPU, the peak allocated/reserved device memory."""
    stats = {"memory/host_rss_gib": psutil.Process().memory_info().rss / GIB}
    if not runtime.is_cpu:
        stats["memory/gpu_max_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        stats["memory/gpu_max_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    return stats


class Stopwatch:
    """Wall-clock seconds since the last reset."""

    def __init__(self):
        self.start = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the last lap (or creation); starts the next lap."""
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        return elapsed


def maybe_float(x) -> Optional[float]:
    """A Python float of a number or one-element tensor; None stays None."""
    if x is None:
        return None
    return float(x.item() if torch.is_tensor(x) else x)
