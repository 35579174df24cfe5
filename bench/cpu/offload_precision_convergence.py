#!/usr/bin/env python3
r"""Validation loss of bf16 Adam moments against exact fp32 states, over several seeds.

The quickstart's corpus and model (``examples/quickstart.sh``: the standard library's text,
a 4096-piece SentencePiece BPE, a 4-layer GPT of hidden 256): the corpus is built into
``--work-dir`` the way quickstart.sh builds it (files that exist are reused), then for
each seed in ``--seeds`` two runs with ``--offload-optimizer`` and the same data order:

* ``fp32``: exact fp32 master weights and moments (12 bytes per element);
* ``bf16``: ``--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``
  (8 bytes per element; the Adam math is fp32, the moments are rounded when stored).

Runs are interleaved (fp32 seed 1, bf16 seed 1, fp32 seed 2, ...). Printed: a markdown table
of the final validation loss (``eval/lm_loss`` at the last iteration) per seed and both
variants, the mean of each and the mean paired difference bf16 - fp32; written to
``--output`` as JSON with every command line.

Example (CPU, about 3 x 2 x 2 minutes on 2 cores)::

    python bench/cpu/offload_precision_convergence.py --output bench/results/precision.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
         "--seq-length", "256", "--max-position-embeddings", "256", "--normalization",
         "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]
VARIANTS = {
    "fp32": [],
    "bf16": ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
             "--exp-avg-sq-dtype", "bf16"],
}


def run(cmd, env=None) -> None:
    """Runs ``cmd`` in the repository root, echoing it; fails on a non-zero exit."""
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, env=env)


def build_corpus(work: str, docs: int) -> str:
    """The quickstart's corpus, tokenizer and .bin/.idx; returns the data prefix."""
    py = sys.executable
    os.makedirs(work, exist_ok=True)
    corpus, model = f"{work}/corpus.jsonl", f"{work}/tokenizer.model"
    if not os.path.exists(corpus):
        run([py, "tools/build_corpus.py", "--output", corpus, "--max-docs", str(docs),
             "--max-chars", "20000", "--seed", "1"])
    if not os.path.exists(model):
        run([py, "tools/train_tokenizer.py", "--input", corpus, "--output-prefix",
             f"{work}/tokenizer", "--vocab-size", "4096", "--model-type", "bpe", "--quiet"])
    if not os.path.exists(f"{work}/stdlib_text_document.idx"):
        run([py, "tools/preprocess_data.py", "--input", corpus, "--output-prefix",
             f"{work}/stdlib", "--tokenizer-type", "GPTSentencePieceTokenizer",
             "--tokenizer-model", model, "--append-eod", "--workers", "2"])
    return f"{work}/stdlib_text_document"


def main() -> None:
    """Builds the corpus, runs every seed and variant, prints and writes the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", default="runs/precision")
    parser.add_argument("--output", default="runs/precision/results.json")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--iters", type=int, default=150)
    parser.add_argument("--docs", type=int, default=1500)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    prefix = build_corpus(args.work_dir, args.docs)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), WANDB_MODE="disabled")
    results = {"commands": {}, "final_val_loss": {}}
    for seed in args.seeds:
        for name, flags in VARIANTS.items():
            metrics = f"{args.work_dir}/{name}-seed{seed}.jsonl"
            if os.path.exists(metrics):
                os.unlink(metrics)
            cmd = [sys.executable, "pretrain_gpt.py", *MODEL, "--micro-batch-size", "8",
                   "--global-batch-size", "16", "--train-iters", str(args.iters), "--lr", "2e-3",
                   "--min-lr", "2e-4", "--lr-warmup-iters", "15", "--lr-decay-style", "cosine",
                   "--weight-decay", "0.1", "--clip-grad", "1.0", "--use-distributed-optimizer",
                   "--hidden-dropout", "0", "--attention-dropout", "0", "--data-path", prefix,
                   "--split", "98,2,0", "--tokenizer-type", "GPTSentencePieceTokenizer",
                   "--tokenizer-model", f"{args.work_dir}/tokenizer.model", "--seed", str(seed),
                   "--log-interval", "10", "--eval-interval", str(args.iters),
                   "--eval-iters", "8", "--device", args.device, "--wandb-mode", "disabled",
                   "--offload-optimizer", *flags, "--metrics-path", metrics]
            start = time.time()
            run(cmd, env=env)
            records = [json.loads(line) for line in open(metrics) if line.strip()]
            evals = [r["eval/lm_loss"] for r in records if "eval/lm_loss" in r]
            key = f"{name}-seed{seed}"
            results["commands"][key] = cmd
            results["final_val_loss"][key] = evals[-1] if evals else None
            print(f"{key}: final validation loss {results['final_val_loss'][key]} "
                  f"({time.time() - start:.0f} s)", flush=True)
    losses = results["final_val_loss"]
    print("\n| seed | fp32 | bf16 moments | bf16 - fp32 |\n|---|---|---|---|")
    diffs = []
    for seed in args.seeds:
        a, b = losses[f"fp32-seed{seed}"], losses[f"bf16-seed{seed}"]
        diffs.append(b - a)
        print(f"| {seed} | {a:.4f} | {b:.4f} | {b - a:+.4f} |")
    means = {n: statistics.mean(losses[f"{n}-seed{s}"] for s in args.seeds) for n in VARIANTS}
    print(f"| mean | {means['fp32']:.4f} | {means['bf16']:.4f} | "
          f"{statistics.mean(diffs):+.4f} |")
    results["mean"] = means
    results["mean_paired_difference"] = statistics.mean(diffs)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
