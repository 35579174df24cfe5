"""Megatron-LM's own launch scripts run here unchanged (shapes shrunk) and mean the same.

The fixtures are the flag sets of Megatron-LM's dense GPT examples at tag core_v0.16.1,
written out here group by group as the scripts have them (bash arrays):
``examples/gpt3/train_gpt3_175b_distributed.sh`` and
``examples/llama/train_llama3_8b_h100_fp8.sh``. Sizes are shrunk to a CPU (layers, hidden
size, sequence, batch, iterations, vocabulary); every flag name is the script's. Each
script trains 3 iterations in one real process. The flags Megatron-LM has and this project
refuses each give exactly one line (in-process: parsing is all they reach).
"""

from __future__ import annotations

import numpy as np
import pytest

import pretrain_gpt
from megatron_ext.config import build_parser, parse_config
from megatron_ext.errors import UsageError
from mext_testing import read_metrics, run_pretrain, write_indexed_dataset

# Flags of the scripts whose values name files this test does not make (GPT-2 BPE files, a
# tiktoken vocabulary): the launch leaves them (and their values) out, and FALLBACK says
# what stands in for them. Every tokenizer type trains in test_tokenizer_types.py.
PENDING = {
    "--vocab-file": "tokenizer files",
    "--merge-file": "tokenizer files",
    "--tiktoken-pattern": "tokenizer files",
}
FALLBACK = {
    # The gpt3 script's GPT-2 BPE files: NullTokenizer over a corpus of ids < 128.
    "--vocab-file": [("--tokenizer-type", "NullTokenizer"), ("--vocab-size", "128")],
}


def gpt3(tmp):
    """examples/gpt3/train_gpt3_175b_distributed.sh, shrunk."""
    return {
        "GPT_MODEL_ARGS": [
            ("--num-layers", "2"), ("--hidden-size", "64"), ("--num-attention-heads", "4"),
            ("--seq-length", "32"), ("--max-position-embeddings", "32"),
            ("--attention-backend", "auto"),
        ],
        "TRAINING_ARGS": [
            ("--micro-batch-size", "1"), ("--global-batch-size", "2"),
            # The script's --rampup-batch-size 16 16 5859375 is left out: Megatron-LM
            # itself refuses it next to --train-iters ("expected no batch-size rampup for
            # iteration-based training").
            ("--train-iters", "3"), ("--weight-decay", "0.1"), ("--adam-beta1", "0.9"),
            ("--adam-beta2", "0.95"), ("--init-method-std", "0.006"), ("--clip-grad", "1.0"),
            ("--fp16",), ("--lr", "6.0e-5"), ("--lr-decay-style", "cosine"),
            ("--min-lr", "6.0e-6"), ("--lr-warmup-fraction", ".001"),
            ("--lr-decay-iters", "3"),
        ],
        "MODEL_PARALLEL_ARGS": [
            ("--tensor-model-parallel-size", "1"), ("--pipeline-model-parallel-size", "1"),
        ],
        "DATA_ARGS": [
            ("--data-path", str(tmp / "corpus_text_document")),
            ("--vocab-file", str(tmp / "gpt2-vocab.json")),
            ("--merge-file", str(tmp / "gpt2-merges.txt")),
            ("--split", "949,50,1"),
        ],
        "EVAL_AND_LOGGING_ARGS": [
            ("--log-interval", "1"), ("--save-interval", "2"), ("--eval-interval", "2"),
            ("--save", str(tmp / "ckpt")), ("--load", str(tmp / "ckpt")),
            ("--eval-iters", "1"), ("--tensorboard-dir", str(tmp / "tb")),
        ],
    }


def llama3(tmp):
    """examples/llama/train_llama3_8b_h100_fp8.sh, shrunk, its mock-data branch, bf16.

    The script's DTYPE=fp8 flags are refusal rows below (FP8 needs Transformer Engine).
    """
    return {
        "MODEL_ARGS": [
            ("--use-mcore-models",), ("--num-layers", "2"), ("--hidden-size", "64"),
            ("--ffn-hidden-size", "224"), ("--num-attention-heads", "4"),
            ("--group-query-attention",), ("--num-query-groups", "2"), ("--kv-channels", "16"),
            ("--seq-length", "32"), ("--max-position-embeddings", "32"),
            ("--position-embedding-type", "rope"), ("--rotary-base", "1000000"),
            ("--rotary-percent", "1.0"), ("--attention-dropout", "0.0"),
            ("--hidden-dropout", "0.0"), ("--swiglu",), ("--init-method-std", "0.0134"),
            ("--attention-backend", "fused"), ("--apply-layernorm-1p",),
            ("--untie-embeddings-and-output-weights",), ("--disable-bias-linear",),
        ],
        "TRAINING_ARGS": [
            # Sample-based, as the script: 12 samples = 3 iterations of 4.
            ("--micro-batch-size", "1"), ("--global-batch-size", "4"),
            ("--train-samples", "12"), ("--lr-decay-samples", "12"),
            ("--lr-warmup-samples", "4"), ("--lr", "0.00015"), ("--min-lr", "0.00001"),
            ("--decoupled-lr", "5.0e-4"), ("--decoupled-min-lr", "4.5e-5"),
            ("--lr-decay-style", "cosine"), ("--clip-grad", "1.0"), ("--weight-decay", "0.1"),
            ("--adam-beta1", "0.9"), ("--adam-beta2", "0.95"), ("--bf16",),
            ("--grad-reduce-in-bf16",), ("--cross-entropy-loss-fusion",),
            ("--calculate-per-token-loss",), ("--manual-gc",),
            ("--empty-unused-memory-level", "1"), ("--exit-duration-in-mins", "235"),
        ],
        "MODEL_PARALLEL_ARGS": [
            ("--tensor-model-parallel-size", "1"), ("--context-parallel-size", "1"),
            ("--sequence-parallel",),
        ],
        "DDP_ARGS": [
            ("--use-distributed-optimizer",), ("--overlap-grad-reduce",),
            ("--overlap-param-gather",),
        ],
        "DATA_ARGS_LIST": [
            ("--mock-data",), ("--tokenizer-type", "NullTokenizer"), ("--vocab-size", "128"),
            ("--data-cache-path", str(tmp / "cache")), ("--tiktoken-pattern", "v2"),
            ("--split", "99,1,0"), ("--no-create-attention-mask-in-dataloader",),
            ("--no-mmap-bin-files",), ("--num-workers", "1"),
        ],
        "EVAL_AND_LOGGING_ARGS": [
            ("--log-interval", "1"), ("--eval-iters", "1"), ("--eval-interval", "2"),
            ("--save-interval", "2"), ("--log-throughput",), ("--profile",),
            # On a CPU: torch.profiler (the script's --profile means nsys, a GPU tool).
            ("--use-pytorch-profiler",),
            ("--profile-step-start", "2"), ("--profile-step-end", "3"),
            ("--ckpt-format", "torch_dist"), ("--distributed-timeout-minutes", "60"),
            ("--save", str(tmp / "ckpt")), ("--load", str(tmp / "ckpt")),
            ("--tensorboard-dir", str(tmp / "tb")),
        ],
    }


# What the scripts do not say and a CPU test needs: this project's flags only.
LOCAL = ["--device", "cpu", "--wandb-mode", "disabled"]


def command(groups: dict) -> list:
    """The script's flags in order, less the pending ones (with their stand-ins)."""
    known = {opt for action in build_parser()._actions for opt in action.option_strings}
    argv = []
    for items in groups.values():
        for flag, *values in items:
            if flag in known and flag not in PENDING:
                argv += [flag, *values]
            elif flag in PENDING:
                for stand_in in FALLBACK.get(flag, []):
                    argv += list(stand_in)
            else:
                raise AssertionError(f"{flag}: neither accepted, refused, nor pending")
    return argv


def _flags(groups: dict) -> list:
    return [flag for items in groups.values() for flag, *_ in items]


@pytest.mark.parametrize("script", [gpt3, llama3])
def test_every_script_flag_is_accepted_or_pending(tmp_path, script):
    groups = script(tmp_path)
    known = {opt for action in build_parser()._actions for opt in action.option_strings}
    unknown = [f for f in _flags(groups) if f not in known and f not in PENDING]
    assert not unknown
    # Parsing alone accepts the whole command (no training length missing, no refusal).
    parse_config(command(groups) + LOCAL)


def _corpus(tmp_path):
    # 2000 documents: the script's --split 949,50,1 leaves 2 of them to the test split
    # (an empty split asked for samples would never fill).
    rng = np.random.default_rng(0)
    write_indexed_dataset(tmp_path / "corpus_text_document",
                          [rng.integers(3, 128, int(rng.integers(40, 90))).tolist()
                           for _ in range(2000)])


def test_gpt3_script_trains(tmp_path):
    groups = gpt3(tmp_path)
    _corpus(tmp_path)
    metrics = tmp_path / "m.jsonl"
    out = run_pretrain([*command(groups), *LOCAL, "--metrics-path", str(metrics)])
    records = [r for r in read_metrics(metrics) if "lm_loss" in r]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(np.isfinite(r["lm_loss"]) for r in records)
    assert all(r["loss_scale"] is not None for r in records)  # --fp16: dynamic loss scale
    # The initial scale 2^32 overflows fp16 every iteration here; skipped iterations are
    # counted per log interval, as Megatron-LM's line (a running total would be 1, 2, 3).
    assert [r["skipped_iterations"] for r in records] == [1, 1, 1]
    # --eval-interval 2 and the end of training; --save-interval 2 and the end.
    assert "validation loss at iteration 2" in out.stdout
    assert "validation loss at iteration 3" in out.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (tmp_path / "ckpt" / "iter_0000002").is_dir()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))  # --tensorboard-dir


def test_llama3_script_trains(tmp_path):
    groups = llama3(tmp_path)
    metrics = tmp_path / "m.jsonl"
    out = run_pretrain([*command(groups), *LOCAL, "--metrics-path", str(metrics),
                        # Where the profiler's files go (this project's flag), not the repo.
                        "--profile-dir", str(tmp_path / "profile")])
    records = [r for r in read_metrics(metrics) if "lm_loss" in r]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(np.isfinite(r["lm_loss"]) for r in records)
    # --decoupled-lr: the embedding and output layer's own schedule; the record's lr is the
    # first param group's, one of the two schedules.
    assert records[0]["lr"] > 0
    lines = out.stdout.splitlines()
    # The fallbacks say so, one line each; --sequence-parallel with TP 1 is off (as there).
    assert any("Transformer Engine is not installed" in line for line in lines)
    assert any(line.startswith("--attention-backend fused:") for line in lines)
    assert any(line.startswith("--sequence-parallel: off") for line in lines)
    assert "throughput per GPU (TFLOP/s/GPU, 6N)" in out.stdout  # --log-throughput
    assert "validation loss at iteration 2" in out.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert list((tmp_path / "profile").iterdir())  # --profile 2..3 wrote its files
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))  # --tensorboard-dir


# Flags (with the scripts' values) Megatron-LM has and this project refuses: the fp8 branch
# of the llama script, the MoE flags of examples/mixtral/train_mixtral_8x7b_distributed.sh,
# and values outside what is supported.
REFUSED = [
    (["--fp8-format", "hybrid"], "--fp8-format: FP8 is not supported"),
    (["--fp8-amax-history-len", "1024"], "--fp8-amax-history-len: FP8 is not supported"),
    (["--fp8-amax-compute-algo", "max"], "--fp8-amax-compute-algo: FP8 is not supported"),
    (["--fp8-param-gather"], "--fp8-param-gather: FP8 is not supported"),
    (["--fp8-recipe", "delayed"], "--fp8-recipe: FP8 is not supported"),
    (["--num-experts", "8"], "--num-experts: mixture-of-experts (MoE) is not supported"),
    (["--moe-router-load-balancing-type", "aux_loss"], "--moe-router-load-balancing-type: "),
    (["--moe-router-topk", "2"], "--moe-router-topk: mixture-of-experts"),
    (["--moe-aux-loss-coeff", "1e-2"], "--moe-aux-loss-coeff: mixture-of-experts"),
    (["--moe-grouped-gemm"], "--moe-grouped-gemm: mixture-of-experts"),
    (["--moe-token-dispatcher-type", "alltoall"], "--moe-token-dispatcher-type: mixture"),
    (["--expert-model-parallel-size", "8"], "--expert-model-parallel-size: mixture"),
    (["--context-parallel-size", "2"], "--context-parallel-size 2: context parallelism is not "
                                       "supported"),
    (["--ckpt-format", "torch"], "--ckpt-format torch: only torch_dist"),
    (["--ckpt-format", "torch_dcp"], "--ckpt-format torch_dcp: only torch_dist"),
    (["--dist-ckpt-strictness", "return_all"], "--dist-ckpt-strictness return_all:"),
    (["--deterministic-mode", "--cross-entropy-loss-fusion"],
     "--deterministic-mode: the fused cross entropy is not deterministic"),
    (["--recompute-granularity", "full"], "--recompute-granularity full needs "
                                          "--recompute-method"),
]
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
        "--lr", "1e-3", "--train-iters", "2", "--mock-data", "--vocab-size", "128", *LOCAL]


@pytest.mark.parametrize("args,message", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_refused_flag_gives_one_line(capsys, args, message):
    # The entry point itself, in-process: a refusal never gets past parsing.
    assert pretrain_gpt.main([*BASE, *args]) == UsageError.exit_code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), captured.err
    assert "Traceback" not in captured.out + captured.err
