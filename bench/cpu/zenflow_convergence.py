#!/usr/bin/env python3
r"""Convergence of ZenFlow selective updates vs plain Adam when fine-tuning a small GPT.

What it runs (every step is a ``pretrain_gpt.py`` or ``tools/*.py`` subprocess with
``OMP_NUM_THREADS=--threads`` and ``WANDB_MODE=disabled``; ``--device cpu`` by default):

1. Pretraining data as in ``examples/quickstart.sh``: the standard library's ``.py`` text
   (``tools/build_corpus.py --kind stdlib-python``), a SentencePiece BPE tokenizer trained on
   it, ``.bin/.idx`` from ``tools/preprocess_data.py``. Built into ``--work-dir``; files that
   already exist there are reused.
2. Pretraining of a small GPT (4 layers, hidden 256, 4 heads, sequence 256 by default) for
   ``--pretrain-iters`` iterations with ``--use-distributed-optimizer --save``. Reused when
   the work dir holds a checkpoint of the same command.
3. The fine-tuning data, of another domain: the English prose of Python's documentation
   topics (``tools/build_corpus.py --kind pydoc-topics``, topic order shuffled with a fixed
   seed), tokenized with the SAME tokenizer, split ``--finetune-split`` by documents (the
   validation split is a set of held-out topics).
4. Fine-tuning from the pretrained weights (``--finetune --load``, a fresh ``--save`` per
   run), ``--finetune-iters`` iterations, the same model, batch and learning-rate schedule
   for both methods, once per method and ``--seeds`` value (the seed sets the data order):
   ``adam`` (plain Adam with the distributed optimizer) and ``zenflow`` (``--zenflow``,
   top-k ratio ``--zenflow-topk-ratio``, update interval S ``--zenflow-update-interval``,
   re-selection every ``--zenflow-select-interval`` steps, ``--zenflow-full-warmup-steps``).
   Runs are interleaved (adam seed 1, zenflow seed 1, adam seed 2, ...) so that load from
   other processes on the machine hits both methods alike. Validation every
   ``--eval-interval`` iterations and at the end, on the same batches each time:
   ``--eval-iters auto`` takes as many global batches as one pass over the validation split
   holds. Before them, per seed, the pretrained model's validation loss on the same batches
   (iteration 0): one step at lr 1e-12 (pretrain_gpt.py refuses lr 0), which leaves the fp32
   weights as they are, then the evaluation.

What it reports, in ``--output-dir``:

* ``results.json``: the date, the machine, every exact command line, data and model sizes,
  the code each run ran (git HEAD, uncommitted files, a hash of ``megatron_ext/`` and
  ``pretrain_gpt.py`` on disk, and whether it changed while the run ran: the working tree
  may be shared; ``code_consistent`` is false, with a warning, when the runs differ),
  per run the final validation loss (``eval/lm_loss`` at the last iteration), wall time,
  median step time and the curves: training ``lm_loss`` per iteration, validation loss per
  evaluation and, for ZenFlow, ``zenflow/rho`` (share of the gradient energy in the delayed
  columns), ``zenflow/retention`` (share of the selected columns kept at the last
  re-selection; null before the first re-selection), ``zenflow/selected_ratio`` and
  ``zenflow/update_interval`` per iteration; and the summary of the table below. A run that
  fails is recorded with its exit status and the tail of its output, and the others go on.
* ``val_loss.png``: validation loss against iteration for every run, from the pretrained
  model's at iteration 0 (and the training loss, smoothed, in a second panel).
* ``zenflow_rho_retention.png``: rho(t) and retention against iteration for the ZenFlow runs.
* on stdout, a markdown table: per method the mean, min, max and standard deviation (n-1) of
  the final validation loss over the seeds, and ZenFlow - Adam (difference of the means, and
  the per-seed paired differences); the pretrained model's loss before fine-tuning as a
  reference row.

Example (about 17 minutes on a 2-core CPU; ``--code-snapshot HEAD`` runs the committed code,
immune to edits of the working tree during the benchmark)::

    python bench/cpu/zenflow_convergence.py --code-snapshot HEAD \
        --output-dir bench/results/zenflow-convergence-2026-11-30
    python bench/cpu/zenflow_convergence.py --dry-run      # print the commands only
"""

from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The code that the subprocesses run: the working tree, or a --code-snapshot of a commit.
CODE_ROOT = REPO_ROOT
METHODS = ("adam", "zenflow")


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _quote(command: Sequence[str]) -> str:
    return " ".join(shlex.quote(str(part)) for part in command)


def _load_average() -> Optional[List[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _git(*args) -> Optional[str]:
    """A read-only git command in the repository; None if it fails."""
    # --no-optional-locks: `git status` writes no index refresh.
    try:
        return subprocess.run(["git", "--no-optional-locks", *args], cwd=REPO_ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def code_snapshot(rev: str, work_dir: str) -> str:
    """Extracts ``git archive <rev>`` under ``work_dir`` (reused if there); returns its path.

    The subprocesses then run that commit's code, whatever happens to the working tree
    (which other people may be editing) during the benchmark.
    """
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    if not commit:
        sys.exit(f"error: --code-snapshot {rev}: not a commit of {REPO_ROOT}")
    root = os.path.join(work_dir, f"code-{commit[:12]}")
    if not os.path.exists(os.path.join(root, "pretrain_gpt.py")):
        os.makedirs(root, exist_ok=True)
        archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=REPO_ROOT,
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
        with open(os.path.join(root, "SNAPSHOT_COMMIT"), "w", encoding="utf-8") as stream:
            stream.write(commit + "\n")
    _log(f"code: snapshot of {commit} in {root}")
    return root


def code_fingerprint() -> dict:
    """The training code as it is on disk now: its commit, uncommitted files, a content hash.

    The working tree may be shared with other people's edits: a run records this before
    and after, so that a change of the code in the middle of the benchmark shows.
    """
    files = sorted(glob.glob(os.path.join(CODE_ROOT, "megatron_ext", "**", "*.py"),
                             recursive=True)) + [os.path.join(CODE_ROOT, "pretrain_gpt.py")]
    digest = hashlib.sha256()
    for path in files:
        digest.update(os.path.relpath(path, CODE_ROOT).encode())
        with open(path, "rb") as stream:
            digest.update(stream.read())
    snapshot = os.path.join(CODE_ROOT, "SNAPSHOT_COMMIT")
    if os.path.exists(snapshot):
        with open(snapshot, encoding="utf-8") as stream:
            return {"code_root": CODE_ROOT, "git_head": stream.read().strip(),
                    "source_sha256": digest.hexdigest()[:16], "uncommitted": []}
    status = _git("status", "--porcelain", "--", "megatron_ext", "pretrain_gpt.py")
    return {"code_root": CODE_ROOT, "git_head": _git("rev-parse", "HEAD"),
            "source_sha256": digest.hexdigest()[:16],
            "uncommitted": status.splitlines() if status else []}


def _finite_or_none(value):
    """JSON has no NaN: a missing or NaN number becomes null."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return value


class Runner:
    """Runs the steps' subprocesses with the benchmark's environment, or prints them."""

    def __init__(self, threads: int, dry_run: bool):
        self.env = dict(os.environ, OMP_NUM_THREADS=str(threads), WANDB_MODE="disabled")
        self.dry_run = dry_run

    def tool(self, name: str, args: Sequence, log_path: str) -> None:
        """Runs ``python tools/<name> args``; exits with its output if it fails."""
        command = [sys.executable, os.path.join(CODE_ROOT, "tools", name), *[str(a) for a in args]]
        proc = self.run(command, log_path)
        if proc is not None and proc["returncode"] != 0:
            sys.exit(f"error: {_quote(command)} exited with {proc['returncode']}:\n"
                     f"{proc['tail']}")

    def run(self, command: Sequence[str], log_path: str) -> Optional[dict]:
        """Runs ``command`` in the code's root directory, its output to ``log_path``.

        Returns:
            ``None`` with ``--dry-run``; else the exit status, the wall time, the load
            average before and after, the last 40 lines of the output, the code fingerprint at
            the start and whether the code changed on disk while it ran.
        """
        if self.dry_run:
            print(_quote(command))
            return None
        load_before = _load_average()
        code_before = code_fingerprint()
        start = time.monotonic()
        with open(log_path, "w", encoding="utf-8") as out:
            returncode = subprocess.run(command, cwd=CODE_ROOT, env=self.env, stdout=out,
                                        stderr=subprocess.STDOUT).returncode
        wall = time.monotonic() - start
        with open(log_path, encoding="utf-8", errors="replace") as stream:
            tail = "".join(stream.readlines()[-40:])
        code_after = code_fingerprint()
        return {"returncode": returncode, "wall_s": round(wall, 1), "load_before": load_before,
                "load_after": _load_average(), "tail": tail, "code": code_before,
                "code_changed_during_run": code_after["source_sha256"]
                != code_before["source_sha256"]}


def model_args(a) -> List[str]:
    """The model and the flags shared by pretraining and fine-tuning."""
    return [
        "--num-layers", a.num_layers, "--hidden-size", a.hidden_size,
        "--num-attention-heads", a.num_heads, "--seq-length", a.seq_length,
        "--max-position-embeddings", a.seq_length, "--normalization", "RMSNorm", "--swiglu",
        "--position-embedding-type", "rope", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--micro-batch-size", a.micro_batch_size, "--global-batch-size", a.global_batch_size,
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--use-distributed-optimizer",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--tokenizer-type", "GPTSentencePieceTokenizer",
        "--tokenizer-model", os.path.join(a.work_dir, "tokenizer.model"),
        "--device", a.device, "--wandb-mode", "disabled", "--log-interval", "1",
    ]


def build_data(a, runner: Runner) -> Dict[str, dict]:
    """Steps 1 and 3: both corpora, the tokenizer, both indexed data sets (reused if there)."""
    w = a.work_dir
    os.makedirs(w, exist_ok=True)
    steps = {
        "stdlib_corpus": (os.path.join(w, "stdlib.jsonl"), "build_corpus.py", [
            "--kind", "stdlib-python", "--output", os.path.join(w, "stdlib.jsonl"),
            "--max-docs", a.stdlib_docs, "--max-chars", 20000, "--seed", 1]),
        "tokenizer": (os.path.join(w, "tokenizer.model"), "train_tokenizer.py", [
            "--input", os.path.join(w, "stdlib.jsonl"), "--output-prefix",
            os.path.join(w, "tokenizer"), "--vocab-size", a.vocab_size, "--model-type", "bpe",
            "--quiet"]),
        "stdlib_preprocess": (os.path.join(w, "stdlib_text_document.idx"), "preprocess_data.py", [
            "--input", os.path.join(w, "stdlib.jsonl"), "--output-prefix",
            os.path.join(w, "stdlib"), "--tokenizer-type", "GPTSentencePieceTokenizer",
            "--tokenizer-model", os.path.join(w, "tokenizer.model"), "--append-eod",
            "--workers", a.threads]),
        "topics_corpus": (os.path.join(w, "topics.jsonl"), "build_corpus.py", [
            "--kind", "pydoc-topics", "--output", os.path.join(w, "topics.jsonl"),
            "--max-chars", a.topics_max_chars, "--seed", 1]),
        "topics_preprocess": (os.path.join(w, "topics_text_document.idx"), "preprocess_data.py", [
            "--input", os.path.join(w, "topics.jsonl"), "--output-prefix",
            os.path.join(w, "topics"), "--tokenizer-type", "GPTSentencePieceTokenizer",
            "--tokenizer-model", os.path.join(w, "tokenizer.model"), "--append-eod",
            "--workers", a.threads]),
    }
    commands = {}
    for name, (product, tool, args) in steps.items():
        command = [sys.executable, os.path.join(CODE_ROOT, "tools", tool), *[str(x) for x in args]]
        reused = os.path.exists(product) and os.path.getsize(product) > 0
        commands[name] = {"command": _quote(command), "reused": reused}
        if reused:
            _log(f"{name}: reusing {product}")
            continue
        _log(f"{name}: {tool}")
        if name.endswith("_preprocess") and not runner.dry_run:
            # megatron-core caches its sample indices under PREFIX/cache, keyed by the
            # prefix and the split, not by the content: new data needs a fresh cache.
            shutil.rmtree(product[:-len(".idx")], ignore_errors=True)
        runner.tool(tool, args, os.path.join(w, f"{name}.log"))
    return commands


def split_sizes(prefix: str, split: str, seq_length: int) -> dict:
    """Documents and tokens of the train/valid parts of ``split`` (megatron-core's rule).

    The split is by documents, in the file's order: part i is documents
    [round(start_i * n), round(end_i * n)), as in BlendedMegatronDatasetBuilder.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    # A copy: the array views the .idx memory map, which closes with the dataset.
    lengths = dataset.sequence_lengths.copy()
    del dataset
    n = len(lengths)
    parts = [float(x) for x in split.split(",")]
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    bounds, acc = [0], 0.0
    for share in parts:
        acc += share / total
        bounds.append(int(round(min(acc, 1.0) * n)))
    out = {"documents": n, "tokens": int(lengths.sum())}
    for i, name in enumerate(("train", "valid", "test")):
        tokens = int(lengths[bounds[i]:bounds[i + 1]].sum())
        out[name] = {"documents": bounds[i + 1] - bounds[i], "tokens": tokens,
                     # GPTDataset's samples per epoch: one extra token per sample for the labels.
                     "samples_per_epoch": max(0, (tokens - 1) // seq_length)}
    return out


def pretrain(a, runner: Runner) -> dict:
    """Step 2: the pretrained checkpoint (reused when the same command made it)."""
    w = a.work_dir
    save = os.path.join(w, "pretrain", "checkpoints")
    metrics = os.path.join(w, "pretrain", "metrics.jsonl")
    command = [sys.executable, os.path.join(CODE_ROOT, "pretrain_gpt.py"), *map(str, [
        *model_args(a), "--train-iters", a.pretrain_iters, "--lr", a.pretrain_lr,
        "--min-lr", a.pretrain_lr / 10, "--lr-warmup-iters", max(1, a.pretrain_iters // 15),
        "--lr-decay-style", "cosine", "--seed", 1234,
        "--data-path", os.path.join(w, "stdlib_text_document"), "--split", "98,2,0",
        "--eval-interval", a.pretrain_iters, "--eval-iters", 8,
        "--save", save, "--metrics-path", metrics])]
    stamp = os.path.join(w, "pretrain", "command.json")
    latest = os.path.join(save, "latest_checkpointed_iteration.txt")
    result = {"command": _quote(command), "checkpoint": save}
    if os.path.exists(stamp) and os.path.exists(latest):
        with open(stamp, encoding="utf-8") as stream:
            same = json.load(stream).get("command") == command
        with open(latest, encoding="utf-8") as stream:
            done = stream.read().strip() == str(a.pretrain_iters)
        if same and done:
            _log(f"pretraining: reusing {save}")
            result["reused"] = True
            with open(stamp, encoding="utf-8") as stream:
                made = json.load(stream)
            result["code"] = made.get("code")  # the code that made the checkpoint
            result["code_changed_during_run"] = made.get("code_changed_during_run")
            result.update(_pretrain_summary(metrics))
            return result
    _log(f"pretraining: {a.pretrain_iters} iterations")
    if not runner.dry_run:
        # A stale checkpoint or appended metrics of another command must not mix in.
        shutil.rmtree(os.path.join(w, "pretrain"), ignore_errors=True)
        os.makedirs(os.path.join(w, "pretrain"), exist_ok=True)
    proc = runner.run(command, os.path.join(w, "pretrain", "stdout.log"))
    if proc is None:
        return result
    result.update({k: proc[k] for k in ("returncode", "wall_s", "load_before", "load_after",
                                        "code", "code_changed_during_run")})
    if proc["returncode"] != 0:
        sys.exit(f"error: pretraining failed ({proc['returncode']}):\n{_quote(command)}\n"
                 f"{proc['tail']}")
    with open(stamp, "w", encoding="utf-8") as stream:
        json.dump({"command": command, "code": proc["code"],
                   "code_changed_during_run": proc["code_changed_during_run"]}, stream)
    result["reused"] = False
    result.update(_pretrain_summary(metrics))
    _log(f"pretraining: done in {proc['wall_s']} s, final validation loss "
         f"{result.get('final_eval_loss')}")
    return result


def _read_metrics(path: str) -> List[dict]:
    with open(path, encoding="utf-8") as stream:
        return [json.loads(line) for line in stream if line.strip()]


def _pretrain_summary(metrics_path: str) -> dict:
    records = _read_metrics(metrics_path)
    train = [r for r in records if "lm_loss" in r]
    evals = [r for r in records if "eval/lm_loss" in r]
    return {"final_train_loss": train[-1]["lm_loss"] if train else None,
            "first_train_loss": train[0]["lm_loss"] if train else None,
            "final_eval_loss": _finite_or_none(evals[-1]["eval/lm_loss"]) if evals else None,
            "median_step_s": statistics.median(r["time/iteration_s"] for r in train[1:])
            if len(train) > 1 else None}


def finetune_command(a, method: str, seed: int, run_dir: str, eval_iters: int) -> List[str]:
    """The fine-tuning command of one run (both methods share everything but --zenflow*)."""
    w = a.work_dir
    args = [
        *model_args(a), "--finetune", "--load", os.path.join(w, "pretrain", "checkpoints"),
        "--save", os.path.join(run_dir, "checkpoints"), "--seed", seed,
        "--train-iters", a.finetune_iters, "--lr", a.finetune_lr,
        "--min-lr", a.finetune_lr / 10, "--lr-warmup-iters", a.finetune_warmup,
        "--lr-decay-style", "cosine",
        "--data-path", os.path.join(w, "topics_text_document"), "--split", a.finetune_split,
        "--eval-interval", a.eval_interval, "--eval-iters", eval_iters,
        "--metrics-path", os.path.join(run_dir, "metrics.jsonl"),
    ]
    if method == "zenflow":
        args += ["--zenflow", "--zenflow-topk-ratio", a.zenflow_topk_ratio,
                 "--zenflow-update-interval", a.zenflow_update_interval,
                 "--zenflow-select-interval", a.zenflow_select_interval,
                 "--zenflow-full-warmup-steps", a.zenflow_full_warmup_steps]
    return [sys.executable, os.path.join(CODE_ROOT, "pretrain_gpt.py"), *map(str, args)]


def baseline_all(a, runner: Runner, eval_iters: int) -> List[dict]:
    """Per seed: the validation loss of the pretrained model, before any fine-tuning.

    The same command as a fine-tuning run but one iteration at lr 1e-12 (Adam's first step
    moves each weight by about lr: below the fp32 rounding of the weights), evaluated after it.
    """
    out = []
    for seed in a.seeds:
        run_dir = os.path.join(a.work_dir, "finetune", f"pretrained-seed{seed}")
        command = finetune_command(a, "adam", seed, run_dir, eval_iters)
        swap = {"--train-iters": "1", "--lr": "1e-12", "--min-lr": "1e-12",
                "--lr-warmup-iters": "0", "--lr-decay-style": "constant", "--eval-interval": "1"}
        for flag, value in swap.items():
            command[command.index(flag) + 1] = value
        drop = command.index("--save")
        del command[drop:drop + 2]
        entry = {"seed": seed, "command": _quote(command)}
        out.append(entry)
        if runner.dry_run:
            print(_quote(command))
            continue
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(run_dir)
        _log(f"pretrained model, seed {seed}: validation loss before fine-tuning")
        proc = runner.run(command, os.path.join(run_dir, "stdout.log"))
        metrics = os.path.join(run_dir, "metrics.jsonl")
        records = _read_metrics(metrics) if os.path.exists(metrics) else []
        evals = [r for r in records if "eval/lm_loss" in r]
        entry.update({"returncode": proc["returncode"], "wall_s": proc["wall_s"],
                      "code": proc["code"],
                      "code_changed_during_run": proc["code_changed_during_run"],
                      "eval_loss": _finite_or_none(evals[-1]["eval/lm_loss"]) if evals else None})
        if entry["eval_loss"] is None:
            entry["error"] = proc["tail"]
            _log(f"pretrained model, seed {seed}: FAILED (exit {proc['returncode']}):\n"
                 f"{proc['tail']}")
        else:
            _log(f"pretrained model, seed {seed}: validation loss {entry['eval_loss']:.4f}")
    return out


def curves(records: List[dict]) -> dict:
    """The per-iteration curves of one run's metrics JSONL."""
    train = [r for r in records if "lm_loss" in r]
    evals = [r for r in records if "eval/lm_loss" in r]
    out = {
        "train": {"iteration": [r["iteration"] for r in train],
                  "lm_loss": [_finite_or_none(r["lm_loss"]) for r in train],
                  "lr": [r.get("lr") for r in train],
                  "step_s": [r.get("time/iteration_s") for r in train]},
        "eval": {"iteration": [r["iteration"] for r in evals],
                 "lm_loss": [_finite_or_none(r["eval/lm_loss"]) for r in evals]},
    }
    if any("zenflow/rho" in r for r in train):
        out["zenflow"] = {
            key: [_finite_or_none(r.get(f"zenflow/{key}")) for r in train]
            for key in ("rho", "retention", "selected_ratio", "update_interval", "stall_s")
        }
    return out


def finetune_all(a, runner: Runner, eval_iters: int) -> List[dict]:
    """Step 4: every (seed, method) run, interleaved."""
    runs = []
    for seed in a.seeds:
        for method in a.methods:
            run_dir = os.path.join(a.work_dir, "finetune", f"{method}-seed{seed}")
            command = finetune_command(a, method, seed, run_dir, eval_iters)
            run = {"method": method, "seed": seed, "command": _quote(command)}
            runs.append(run)
            if runner.dry_run:
                print(_quote(command))
                continue
            # --metrics-path appends: a rerun starts from an empty directory.
            shutil.rmtree(run_dir, ignore_errors=True)
            os.makedirs(run_dir)
            _log(f"fine-tuning: {method} seed {seed}")
            proc = runner.run(command, os.path.join(run_dir, "stdout.log"))
            run.update({k: proc[k] for k in ("returncode", "wall_s", "load_before",
                                              "load_after", "code", "code_changed_during_run")})
            metrics = os.path.join(run_dir, "metrics.jsonl")
            records = _read_metrics(metrics) if os.path.exists(metrics) else []
            run["curves"] = curves(records)
            evals = run["curves"]["eval"]
            final = (evals["lm_loss"][-1] if evals["iteration"]
                     and evals["iteration"][-1] == a.finetune_iters else None)
            run["final_eval_loss"] = final
            steps = [s for s in run["curves"]["train"]["step_s"][1:] if s is not None]
            run["median_step_s"] = statistics.median(steps) if steps else None
            if proc["returncode"] != 0 or final is None:
                run["error"] = proc["tail"]
                _log(f"fine-tuning: {method} seed {seed} FAILED (exit {proc['returncode']}):\n"
                     f"{proc['tail']}")
            else:
                _log(f"fine-tuning: {method} seed {seed}: final validation loss {final:.4f} "
                     f"in {proc['wall_s']} s")
            if not a.keep_finetune_checkpoints:
                shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
    return runs


def _stats(values: List[float]) -> dict:
    return {
        "n": len(values), "values": values,
        "mean": statistics.fmean(values) if values else None,
        "min": min(values) if values else None, "max": max(values) if values else None,
        "std": statistics.stdev(values) if len(values) > 1 else None,
    }


def summarize(runs: List[dict], methods: Sequence[str], baseline: List[dict]) -> dict:
    """Per method: n, mean, min, max, std (n-1) of the final validation loss; the difference."""
    summary: Dict[str, dict] = {
        "pretrained": _stats([b["eval_loss"] for b in baseline if b.get("eval_loss") is not None])
    }
    for method in methods:
        values = [r["final_eval_loss"] for r in runs
                  if r["method"] == method and r.get("final_eval_loss") is not None]
        summary[method] = {
            "n": len(values), "values": values,
            "mean": statistics.fmean(values) if values else None,
            "min": min(values) if values else None, "max": max(values) if values else None,
            "std": statistics.stdev(values) if len(values) > 1 else None,
        }
    if set(methods) >= {"adam", "zenflow"} and summary["adam"]["n"] and summary["zenflow"]["n"]:
        by_seed = {}
        for r in runs:
            if r.get("final_eval_loss") is not None:
                by_seed.setdefault(r["seed"], {})[r["method"]] = r["final_eval_loss"]
        paired = {seed: v["zenflow"] - v["adam"] for seed, v in sorted(by_seed.items())
                  if {"adam", "zenflow"} <= set(v)}
        diffs = list(paired.values())
        summary["zenflow_minus_adam"] = {
            "mean_difference": summary["zenflow"]["mean"] - summary["adam"]["mean"],
            "paired_by_seed": paired,
            "paired_min": min(diffs) if diffs else None,
            "paired_max": max(diffs) if diffs else None,
            "paired_std": statistics.stdev(diffs) if len(diffs) > 1 else None,
        }
    return summary


def markdown_table(summary: dict, methods: Sequence[str]) -> str:
    """The summary as markdown (stdout and BENCHMARKS.md)."""
    fmt = lambda x: "n/a" if x is None else f"{x:.4f}"  # noqa: E731
    lines = ["| method | seeds | final val loss mean | min | max | std (n-1) |",
             "|---|---:|---:|---:|---:|---:|"]
    names = {"adam": "plain Adam", "zenflow": "ZenFlow",
             "pretrained": "pretrained, not fine-tuned (iteration 0)"}
    for method in ["pretrained", *methods]:
        s = summary[method]
        lines.append(f"| {names.get(method, method)} | {s['n']} | {fmt(s['mean'])} | "
                     f"{fmt(s['min'])} | {fmt(s['max'])} | {fmt(s['std'])} |")
    diff = summary.get("zenflow_minus_adam")
    if diff:
        per_seed = ", ".join(f"seed {k}: {v:+.4f}" for k, v in diff["paired_by_seed"].items())
        lines.append(f"| ZenFlow - Adam | | {diff['mean_difference']:+.4f} | "
                     f"{fmt(diff['paired_min'])} | {fmt(diff['paired_max'])} | "
                     f"{fmt(diff['paired_std'])} |")
        lines.append("")
        lines.append(f"ZenFlow - Adam per seed (paired): {per_seed}; the min / max / std "
                     "of that row are over these paired differences.")
    return "\n".join(lines)


def plot(runs: List[dict], baseline: List[dict], out_dir: str, title: str) -> List[str]:
    """The two PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"adam": "tab:blue", "zenflow": "tab:orange"}
    styles = {1: "-", 2: "--", 3: ":"}
    start = {b["seed"]: b["eval_loss"] for b in baseline if b.get("eval_loss") is not None}
    fig, (ax_val, ax_train) = plt.subplots(1, 2, figsize=(13, 4.8))
    for run in runs:
        if "curves" not in run:
            continue
        label = f"{run['method']} seed {run['seed']}"
        style = styles.get(run["seed"], "-.")
        ev = run["curves"]["eval"]
        xs, ys = list(ev["iteration"]), list(ev["lm_loss"])
        if run["seed"] in start:  # the curve starts at the pretrained model's loss
            xs, ys = [0, *xs], [start[run["seed"]], *ys]
        ax_val.plot(xs, ys, style, marker="o", ms=3, color=colors.get(run["method"]),
                    label=label)
        tr = run["curves"]["train"]
        window = 10
        xs, ys = tr["iteration"], [y for y in tr["lm_loss"]]
        smooth = [statistics.fmean(v for v in ys[max(0, i - window + 1):i + 1] if v is not None)
                  for i in range(len(ys))]
        ax_train.plot(xs, smooth, style, color=colors.get(run["method"]), label=label)
    ax_val.set(title="validation loss (pydoc-topics, held-out topics; 0 = pretrained)",
               xlabel="iteration",
               ylabel="lm loss")
    ax_train.set(title="training loss (mean of the last 10 iterations)", xlabel="iteration",
                 ylabel="lm loss")
    for ax in (ax_val, ax_train):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    val_path = os.path.join(out_dir, "val_loss.png")
    fig.savefig(val_path, dpi=110)
    plt.close(fig)

    fig, (ax_rho, ax_ret) = plt.subplots(1, 2, figsize=(13, 4.8))
    for run in runs:
        zf = run.get("curves", {}).get("zenflow")
        if not zf:
            continue
        xs = run["curves"]["train"]["iteration"]
        style = styles.get(run["seed"], "-.")
        ax_rho.plot(xs, [math.nan if v is None else v for v in zf["rho"]], style,
                    label=f"seed {run['seed']}")
        ax_ret.plot(xs, [math.nan if v is None else v for v in zf["retention"]], style,
                    marker=".", ms=4, drawstyle="steps-post", label=f"seed {run['seed']}")
    ax_rho.set(title="rho(t): share of gradient energy in the delayed columns",
               xlabel="iteration", ylabel="rho", ylim=(0, 1))
    ax_ret.set(title="retention: share of selected columns kept at the last re-selection",
               xlabel="iteration", ylabel="retention", ylim=(0, 1.02))
    for ax in (ax_rho, ax_ret):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    zf_path = os.path.join(out_dir, "zenflow_rho_retention.png")
    fig.savefig(zf_path, dpi=110)
    plt.close(fig)
    return [val_path, zf_path]


def machine_info() -> dict:
    """Platform, CPU model and count, torch version."""
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "processor": platform.processor()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as stream:
            for line in stream:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda_available"] = torch.cuda.is_available()
    except ImportError:
        pass
    return info


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; --help describes every flag."""
    p = argparse.ArgumentParser(
        prog="bench/cpu/zenflow_convergence.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    d = "(default: %(default)s)"
    p.add_argument("--work-dir", default=os.path.join(REPO_ROOT, "runs", "zenflow-convergence"),
                   help=f"data, checkpoints, per-run logs and metrics {d}")
    p.add_argument("--output-dir", default=None,
                   help="results.json and the PNGs (default: "
                        "bench/results/zenflow-convergence-<today>)")
    p.add_argument("--threads", type=int, default=2, help=f"OMP_NUM_THREADS of every step {d}")
    p.add_argument("--code-snapshot", metavar="REV", default=None,
                   help="run pretrain_gpt.py and tools/ from `git archive REV` extracted into "
                        "the work dir, not from the working tree, so that edits to the "
                        "working tree during the benchmark do not reach the runs (default: "
                        "the working tree; a change during the benchmark is then detected "
                        "and reported)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"], help=d)
    g = p.add_argument_group("data")
    g.add_argument("--stdlib-docs", type=int, default=1500,
                   help=f"documents of the pretraining corpus (as the quickstart) {d}")
    g.add_argument("--vocab-size", type=int, default=4096, help=d)
    g.add_argument("--topics-max-chars", type=int, default=4000,
                   help=f"build_corpus.py --max-chars of the pydoc-topics corpus {d}")
    g.add_argument("--finetune-split", default="85,15,0",
                   help=f"train,valid,test shares of the pydoc-topics documents {d}")
    g = p.add_argument_group("model and batch")
    g.add_argument("--num-layers", type=int, default=4, help=d)
    g.add_argument("--hidden-size", type=int, default=256, help=d)
    g.add_argument("--num-heads", type=int, default=4, help=d)
    g.add_argument("--seq-length", type=int, default=256, help=d)
    g.add_argument("--micro-batch-size", type=int, default=8, help=d)
    g.add_argument("--global-batch-size", type=int, default=8, help=d)
    g = p.add_argument_group("pretraining")
    g.add_argument("--pretrain-iters", type=int, default=300, help=d)
    g.add_argument("--pretrain-lr", type=float, default=3e-3,
                   help=f"peak lr; cosine to lr/10 after a warm-up of iters/15 {d}")
    g = p.add_argument_group("fine-tuning")
    g.add_argument("--finetune-iters", type=int, default=120, help=d)
    g.add_argument("--finetune-lr", type=float, default=1e-3,
                   help=f"peak lr; cosine to lr/10, the same for both methods {d}")
    g.add_argument("--finetune-warmup", type=int, default=10, help=f"lr warm-up iterations {d}")
    g.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help=d)
    g.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, help=d)
    g.add_argument("--eval-interval", type=int, default=20, help=d)
    g.add_argument("--eval-iters", default="auto",
                   help="global batches per evaluation; auto: as many as one pass over the "
                        f"validation split holds {d}")
    g.add_argument("--zenflow-topk-ratio", type=float, default=0.1, help=d)
    g.add_argument("--zenflow-update-interval", default="4", help=f"S {d}")
    g.add_argument("--zenflow-select-interval", type=int, default=20, help=d)
    g.add_argument("--zenflow-full-warmup-steps", type=int, default=0, help=d)
    g.add_argument("--keep-finetune-checkpoints", action="store_true",
                   help="keep each fine-tuning run's --save directory (deleted by default)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the commands (data steps that would run, pretraining, "
                        "fine-tuning) and exit")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs every step and writes the results; 1 when a fine-tuning run failed."""
    global CODE_ROOT
    a = build_parser().parse_args(argv)
    a.work_dir = os.path.abspath(a.work_dir)
    if a.code_snapshot:
        os.makedirs(a.work_dir, exist_ok=True)
        CODE_ROOT = code_snapshot(a.code_snapshot, a.work_dir)
    started = time.monotonic()
    date = datetime.datetime.now(datetime.timezone.utc)
    out_dir = a.output_dir or os.path.join(
        REPO_ROOT, "bench", "results", f"zenflow-convergence-{date.date().isoformat()}")
    runner = Runner(a.threads, a.dry_run)
    data_commands = build_data(a, runner)
    pretrained = pretrain(a, runner)
    if a.dry_run:
        eval_iters = a.eval_iters if a.eval_iters != "auto" else "<auto>"
        baseline_all(a, runner, eval_iters)
        finetune_all(a, runner, eval_iters)
        return 0
    sizes = {
        "stdlib": split_sizes(os.path.join(a.work_dir, "stdlib_text_document"), "98,2,0",
                              a.seq_length),
        "topics": split_sizes(os.path.join(a.work_dir, "topics_text_document"),
                              a.finetune_split, a.seq_length),
    }
    valid_samples = sizes["topics"]["valid"]["samples_per_epoch"]
    if a.eval_iters == "auto":
        eval_iters = max(1, valid_samples // a.global_batch_size)
    else:
        eval_iters = int(a.eval_iters)
    _log(f"pydoc-topics: {sizes['topics']['train']['tokens']} training tokens, "
         f"{sizes['topics']['valid']['tokens']} validation tokens ({valid_samples} samples "
         f"of {a.seq_length}); {eval_iters} evaluation batches of {a.global_batch_size}")
    baseline = baseline_all(a, runner, eval_iters)
    runs = finetune_all(a, runner, eval_iters)
    summary = summarize(runs, a.methods, baseline)
    # Every fine-tuning run (and iteration-0 evaluation) must have run the same code.
    versions = {r["code"]["source_sha256"] for r in [*baseline, *runs] if r.get("code")}
    changed = [r for r in [*baseline, *runs] if r.get("code_changed_during_run")]
    code_consistent = len(versions) <= 1 and not changed
    if not code_consistent:
        _log(f"WARNING: the code under megatron_ext/ changed during the benchmark "
             f"({len(versions)} versions, {len(changed)} run(s) changed while running): "
             "the runs are not comparable; see code/code_changed_during_run in results.json")
    table = markdown_table(summary, a.methods)
    os.makedirs(out_dir, exist_ok=True)
    title = (f"{a.num_layers}-layer GPT (hidden {a.hidden_size}) pretrained "
             f"{a.pretrain_iters} it. on stdlib code, fine-tuned {a.finetune_iters} it. on "
             f"pydoc topics: Adam vs ZenFlow (k={a.zenflow_topk_ratio}, "
             f"S={a.zenflow_update_interval}, select every {a.zenflow_select_interval})")
    pngs = plot(runs, baseline, out_dir, title)
    result = {
        "benchmark": "zenflow-convergence",
        "date": date.isoformat(timespec="seconds"),
        "command": _quote([sys.executable, *sys.argv]),
        "arguments": vars(a),
        "machine": machine_info(),
        "environment": {"OMP_NUM_THREADS": str(a.threads), "WANDB_MODE": "disabled"},
        "data_commands": data_commands,
        "data_sizes": sizes,
        "eval_iters": eval_iters,
        "eval_samples": eval_iters * a.global_batch_size,
        "pretraining": pretrained,
        "pretrained_eval_before_finetuning": baseline,
        "runs": runs,
        "summary": summary,
        "table_markdown": table,
        "plots": [os.path.relpath(p, REPO_ROOT) for p in pngs],
        "code_consistent": code_consistent,
        "code_at_end": code_fingerprint(),
        "total_wall_s": round(time.monotonic() - started, 1),
    }
    path = os.path.join(out_dir, "results.json")
    with open(path, "w", encoding="utf-8") as stream:
        json.dump(result, stream, indent=1, allow_nan=False)
        stream.write("\n")
    print(table)
    print(f"\nresults: {path}\nplots: {', '.join(pngs)}\ntotal: {result['total_wall_s']} s")
    if not code_consistent:
        print("WARNING: the code changed during the benchmark (see results.json)")
    failed = [r for r in runs if "error" in r]
    if failed:
        print(f"{len(failed)} run(s) failed: "
              + ", ".join(f"{r['method']} seed {r['seed']}" for r in failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
