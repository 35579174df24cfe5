"""Each bad input gives one line on stderr, exit status 2, and no traceback.

FLAG_CASES fail while the flags are parsed, LAUNCH_CASES at the launch checks (world size,
launcher variables) before anything global is set up: both run in this process, through
pretrain_gpt.main (milliseconds each). CASES and ENV_CASES need the run to start (data
files, tokenizers, checkpoints, offload tiers, the engines' environment) and run as
processes, as do a few cases of the in-process kinds, so the real process path is proven
for each. The tools' table is in test_bad_input_tools.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from mext_testing import PRETRAIN, ROOT, assert_one_error_line, test_env, write_indexed_dataset

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2",
        "--device", "cpu", "--wandb-mode", "disabled", "--eval-iters", "0",
        "--max-position-embeddings", "16", "--lr", "1e-3", "--num-workers", "0"]
MOCK = ["--mock-data", "--vocab-size", "100"]
OFFLOAD = ["--use-distributed-optimizer", "--offload-optimizer"]
ZENFLOW = ["--use-distributed-optimizer", "--zenflow"]


@pytest.fixture(scope="module")
def data(tmp_path_factory, run_cache):
    root = tmp_path_factory.mktemp("bad-input")
    rng = np.random.default_rng(0)
    write_indexed_dataset(root / "ok", [rng.integers(0, 100, 40).tolist() for _ in range(50)])
    write_indexed_dataset(root / "bigvocab", [[1, 2, 500, 3]] * 50)
    (root / "garbage.idx").write_bytes(b"not an index at all, really")
    (root / "garbage.bin").write_bytes(b"\x00" * 64)
    (root / "dirbin.idx").write_bytes((root / "ok.idx").read_bytes())
    (root / "dirbin.bin").mkdir()
    (root / "empty_ckpt").mkdir()
    (root / "fake.model").write_bytes(b"this is not a sentencepiece model")
    # A checkpoint with offloaded optimizer state (once a session), copied: one copy keeps
    # it whole, one byte of the other is then flipped.
    saved = run_cache.run([*BASE, *MOCK, *OFFLOAD, "--save", "{run}/ckpt"]).directory / "ckpt"
    shutil.copytree(saved, root / "offload_ckpt")
    shutil.copytree(saved, root / "good_ckpt")
    _more_data(root)
    state = sorted((root / "offload_ckpt").rglob("sg00000.state"))[0]
    data = bytearray(state.read_bytes())
    data[4096 + 8] ^= 0x01
    state.write_bytes(bytes(data))
    return root


def _more_data(root):
    """Damaged data files and 'latest' pointers (the cases after the first table)."""
    rng = np.random.default_rng(1)
    ok_idx, ok_bin = (root / "ok.idx").read_bytes(), (root / "ok.bin").read_bytes()
    (root / "truncbin.idx").write_bytes(ok_idx)
    (root / "truncbin.bin").write_bytes(ok_bin[:-10])
    write_indexed_dataset(root / "long", [rng.integers(0, 100, 60).tolist() for _ in range(50)])
    (root / "pastbin.idx").write_bytes((root / "long.idx").read_bytes())
    (root / "pastbin.bin").write_bytes(ok_bin)
    write_indexed_dataset(root / "other", [rng.integers(0, 100, 45).tolist() for _ in range(50)])
    (root / "foreign.idx").write_bytes(ok_idx)
    (root / "foreign.bin").write_bytes((root / "other.bin").read_bytes())
    (root / "truncidx.idx").write_bytes(ok_idx[:-100])
    (root / "truncidx.bin").write_bytes(ok_bin)
    write_indexed_dataset(root / "small", [rng.integers(0, 100, 40).tolist() for _ in range(120)])
    for name, text in (("ptr_nonascii", "\u0663".encode()), ("ptr_badutf8", b"\xff\xfe3"),
                       ("ptr_release", b"release"), ("ptr_no_iter", b"7"),
                       ("ptr_empty_iter", b"2")):
        (root / name).mkdir()
        (root / name / "latest_checkpointed_iteration.txt").write_bytes(text)
    (root / "ptr_empty_iter" / "iter_0000002").mkdir()


def null_data(prefix):
    return ["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


def tokenizer(kind, *files):
    """--data-path of a corpus that need not exist: the tokenizer fails first."""
    flags = {"GPT2BPETokenizer": ["--vocab-file", "--merge-file"]}.get(kind, ["--tokenizer-model"])
    return ["--data-path", "corpus", "--tokenizer-type", kind,
            *[x for pair in zip(flags, files) for x in pair]]


class Argv(list):
    """A whole command line, not one to append to BASE."""


def without(flag, *more):
    """BASE with ``flag`` and its value removed (a required flag left out), then ``more``."""
    i = BASE.index(flag)
    return Argv([*BASE[:i], *BASE[i + 2:], *more])


def command_line(args):
    return args if isinstance(args, Argv) else [*BASE, *args]


# Cases that fail while the flags are parsed: (argv after BASE, or an Argv; expected fragment).
# ``d`` is a directory holding the file ``afile``.
FLAG_CASES = {
    # Megatron-LM's required flags, each left out.
    **{f"missing {flag}": (lambda d, flag=flag: without(flag, *MOCK),
                           f"{flag} is required (Megatron-LM has no default for it either)")
       for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                    "--max-position-embeddings", "--micro-batch-size", "--lr")},
    "missing training length": (lambda d: without("--train-iters", *MOCK),
                                "the training length is required: give --train-iters N"),
    # Numbers out of their range.
    "zero layers": (lambda d: MOCK + ["--num-layers", "0"], "--num-layers must be positive, got 0"),
    "negative hidden size": (lambda d: MOCK + ["--hidden-size", "-64"],
                             "--hidden-size must be positive, got -64"),
    "zero micro batch": (lambda d: MOCK + ["--micro-batch-size", "0"],
                         "--micro-batch-size must be positive, got 0"),
    "zero global batch": (lambda d: MOCK + ["--global-batch-size", "0"],
                          "--global-batch-size must be positive, got 0"),
    "negative lr": (lambda d: MOCK + ["--lr", "-1"], "--lr must be positive"),
    "negative train iters": (lambda d: MOCK + ["--train-iters", "-1"],
                             "--train-iters must be >= 0"),
    "sequence longer than the positions": (
        lambda d: MOCK + ["--seq-length", "32"],
        "--max-position-embeddings 16 must be greater than or equal to --seq-length 32"),
    "rotary percent zero": (lambda d: MOCK + ["--rotary-percent", "0"],
                            "--rotary-percent must be in (0, 1], got 0.0"),
    "dropout of one": (lambda d: MOCK + ["--hidden-dropout", "1.0"],
                       "--hidden-dropout must be in [0, 1)"),
    "adam beta2 of one": (lambda d: MOCK + ["--adam-beta2", "1"], "--adam-beta2 must be in [0, 1)"),
    "adam eps zero": (lambda d: MOCK + ["--adam-eps", "0"], "--adam-eps must be positive, got 0.0"),
    "min lr above lr": (lambda d: MOCK + ["--min-lr", "1e-2"],
                        "--min-lr 0.01 must be in [0, --lr 0.001]"),
    "negative clip grad": (lambda d: MOCK + ["--clip-grad", "-1"],
                           "--lr-warmup-iters, --weight-decay and --clip-grad must be >= 0"),
    "clip grad inf": (lambda d: MOCK + ["--clip-grad", "inf"],
                      "--clip-grad inf: must be a finite number"),
    "decay over zero iterations": (lambda d: MOCK + ["--lr-decay-iters", "0"],
                                   "--lr-decay-iters must be positive, got 0"),
    "decoupled min lr without decoupled lr": (lambda d: MOCK + ["--decoupled-min-lr", "1e-4"],
                                              "--decoupled-min-lr needs --decoupled-lr"),
    "decoupled min lr above decoupled lr": (
        lambda d: MOCK + ["--decoupled-lr", "1e-3", "--decoupled-min-lr", "1e-2"],
        "--decoupled-min-lr 0.01 must be in [0, --decoupled-lr 0.001]"),
    "offload fraction above one": (lambda d: MOCK + ["--optimizer-offload-fraction", "1.5"],
                                   "--optimizer-offload-fraction must be in [0, 1]"),
    "negative eval iters": (lambda d: MOCK + ["--eval-iters", "-1"], "--eval-iters must be >= 0"),
    "log interval zero": (lambda d: MOCK + ["--log-interval", "0"],
                          "--log-interval must be positive, got 0"),
    "save interval zero": (lambda d: MOCK + ["--save", f"{d}/ck", "--save-interval", "0"],
                           "--save-interval must be positive, got 0"),
    "vocab size zero": (lambda d: ["--mock-data", "--vocab-size", "0"],
                        "--vocab-size must be positive, got 0"),
    "static loss scale zero": (lambda d: MOCK + ["--loss-scale", "0"],
                               "--loss-scale must be positive, got 0.0"),
    "negative data workers": (lambda d: MOCK + ["--num-workers", "-1"],
                              "--num-workers must be >= 0"),
    "tensor parallel zero": (lambda d: MOCK + ["--tensor-model-parallel-size", "0"],
                             "--tensor-model-parallel-size must be positive, got 0"),
    "query groups zero": (lambda d: MOCK + ["--group-query-attention", "--num-query-groups", "0"],
                          "--num-query-groups must be positive, got 0"),
    "offload host cache negative": (lambda d: MOCK + OFFLOAD + ["--offload-host-cache-gb", "-1"],
                                    "--offload-host-cache-gb -1: give a size in GB (>= 0; 0 "
                                    "for no host cache, the states in files on "
                                    "--offload-paths) or auto"),
    "offload host cache inf": (lambda d: MOCK + OFFLOAD + ["--offload-host-cache-gb", "inf"],
                               "--offload-host-cache-gb inf: must be a finite number"),
    "offload subgroup size zero": (lambda d: MOCK + OFFLOAD + ["--offload-subgroup-size", "0"],
                                   "--offload-subgroup-size must be positive"),
    "offload device cache not a size": (
        lambda d: MOCK + OFFLOAD + ["--offload-device-cache-gb", "lots"],
        "--offload-device-cache-gb lots: give a size in GB (>= 0) or auto"),
    "zenflow ratio out of range": (lambda d: MOCK + ZENFLOW + ["--zenflow-topk-ratio", "0"],
                                   "--zenflow-topk-ratio 0.0: must be in (0, 1]"),
    "zenflow interval not a number": (
        lambda d: MOCK + ZENFLOW + ["--zenflow-update-interval", "often"],
        "give a number of steps or auto"),
    "zenflow interval zero": (lambda d: MOCK + ZENFLOW + ["--zenflow-update-interval", "0"],
                              "--zenflow-update-interval must be positive (or auto)"),
    "zenflow negative warm-up": (lambda d: MOCK + ZENFLOW + ["--zenflow-full-warmup-steps", "-1"],
                                 "--zenflow-full-warmup-steps must be >= 0"),
    # Contradictory combinations.
    "hidden not divisible by heads": (
        lambda d: MOCK + ["--num-attention-heads", "5"],
        "--hidden-size 64 is not divisible by --num-attention-heads 5"),
    "heads not divisible by query groups": (
        lambda d: MOCK + ["--group-query-attention", "--num-query-groups", "3"],
        "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
    "full recompute without a method": (
        lambda d: MOCK + ["--recompute-granularity", "full"],
        "--recompute-granularity full needs --recompute-method {uniform,block}"),
    "selective recompute with a method": (
        lambda d: MOCK + ["--recompute-granularity", "selective", "--recompute-method", "block"],
        "--recompute-method is for --recompute-granularity full"),
    "selective recompute with sdpa": (
        lambda d: MOCK + ["--recompute-granularity", "selective", "--attention-backend", "sdpa"],
        "--recompute-granularity selective has no effect with the SDPA core attention"),
    "deterministic with fused cross entropy": (
        lambda d: MOCK + ["--deterministic-mode", "--cross-entropy-loss-fusion"],
        "drop --cross-entropy-loss-fusion"),
    "bf16 grad reduce without bf16": (lambda d: MOCK + ["--grad-reduce-in-bf16"],
                                      "--grad-reduce-in-bf16 needs --bf16"),
    "bf16 and fp32 grad reduce": (
        lambda d: MOCK + ["--bf16", "--grad-reduce-in-bf16",
                          "--accumulate-allreduce-grads-in-fp32"],
        "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 are exclusive"),
    "context parallel": (lambda d: MOCK + ["--context-parallel-size", "2"],
                         "--context-parallel-size 2: context parallelism is not supported"),
    "both virtual pipeline flags": (
        lambda d: MOCK + ["--num-layers-per-virtual-pipeline-stage", "1",
                          "--num-virtual-stages-per-pipeline-rank", "2"],
        "give one of them"),
    "param gather without distributed optimizer": (
        lambda d: MOCK + ["--overlap-param-gather"], "needs --use-distributed-optimizer"),
    "mock and data path": (lambda d: MOCK + ["--data-path", f"{d}/ok"], "are exclusive"),
    "no data": (lambda d: ["--vocab-size", "100"], "no training data"),
    "finetune without load": (lambda d: MOCK + ["--finetune"], "--finetune needs --load"),
    "use checkpoint args without load": (lambda d: MOCK + ["--use-checkpoint-args"],
                                         "--use-checkpoint-args needs --load"),
    "both scheduler sources": (
        lambda d: MOCK + ["--load", str(d), "--override-opt_param-scheduler",
                          "--use-checkpoint-opt_param-scheduler"],
        "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are exclusive"),
    "checkpoint format torch": (lambda d: MOCK + ["--ckpt-format", "torch"],
                                "--ckpt-format torch: only torch_dist"),
    "strictness that returns keys": (lambda d: MOCK + ["--dist-ckpt-strictness", "return_all"],
                                     "nothing here reads the returned key lists"),
    "skip train without evaluation": (lambda d: MOCK + ["--skip-train"],
                                      "--skip-train only evaluates: give --eval-iters N > 0"),
    "profile range backwards": (lambda d: MOCK + ["--profile", "--profile-step-start", "5",
                                                  "--profile-step-end", "3"],
                                "--profile needs 0 <= --profile-step-start < --profile-step-end"),
    "pytorch profiler without profile": (lambda d: MOCK + ["--use-pytorch-profiler"],
                                         "--use-pytorch-profiler chooses how --profile profiles"),
    "tensorboard flag without tensorboard dir": (
        lambda d: MOCK + ["--log-timers-to-tensorboard"],
        "--log-timers-to-tensorboard writes to TensorBoard: add --tensorboard-dir DIR"),
    "megatron host offload without distributed optimizer": (
        lambda d: MOCK + ["--optimizer-cpu-offload"],
        "--optimizer-cpu-offload needs --use-distributed-optimizer"),
    "megatron host offload with fp16": (
        lambda d: MOCK + ["--use-distributed-optimizer", "--optimizer-cpu-offload", "--fp16"],
        "--optimizer-cpu-offload does not support --fp16; use --bf16"),
    "offload with sgd": (lambda d: MOCK + OFFLOAD + ["--optimizer", "sgd"],
                         "--offload-optimizer supports --optimizer adam only"),
    "two offloads at once": (lambda d: MOCK + OFFLOAD + ["--optimizer-cpu-offload"],
                             "two offloads of the same states; choose one"),
    "offload without distributed optimizer": (lambda d: MOCK + ["--offload-optimizer"],
                                              "add --use-distributed-optimizer"),
    "offload paths without offload": (lambda d: MOCK + ["--offload-paths", str(d)],
                                      "--offload-paths needs --offload-optimizer"),
    "offload path missing": (
        lambda d: MOCK + OFFLOAD + ["--offload-paths", f"{d}/no-such-dir"], "no-such-dir"),
    "offload path given twice": (
        lambda d: MOCK + OFFLOAD + ["--offload-paths", f"{d}@1,1", f"{d}/."],
        "the same directory"),
    "offload bandwidth not a number": (
        lambda d: MOCK + OFFLOAD + ["--offload-paths", f"{d}@fast,2"],
        "bandwidths must be positive numbers"),
    "offload run id an absolute path": (
        lambda d: MOCK + OFFLOAD + ["--offload-run-id", f"{d}/elsewhere"],
        "a run id is one directory name"),
    "offload run id with a slash": (lambda d: MOCK + OFFLOAD + ["--offload-run-id", "job/1"],
                                    "--offload-run-id 'job/1': a run id is one directory name"),
    "offload run id dot-dot": (lambda d: MOCK + OFFLOAD + ["--offload-run-id", ".."],
                               "(not '.' or '..')"),
    "precision-aware optimizer without offload": (
        lambda d: MOCK + ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16"],
        "honoured by --offload-optimizer only"),
    "state dtype without precision-aware optimizer": (
        lambda d: MOCK + OFFLOAD + ["--exp-avg-dtype", "bf16"],
        "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
    "fp8 optimizer states": (
        lambda d: MOCK + OFFLOAD + ["--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "fp8"],
        "--exp-avg-sq-dtype fp8 is not supported"),
    "zenflow without distributed optimizer": (lambda d: MOCK + ["--zenflow"],
                                              "add --use-distributed-optimizer"),
    "zenflow selection more often than updates": (
        lambda d: MOCK + ZENFLOW + ["--zenflow-select-interval", "2"],
        "shorter than --zenflow-update-interval 4"),
    "zenflow flag without zenflow": (lambda d: MOCK + ["--zenflow-topk-ratio", "0.2"],
                                     "--zenflow-topk-ratio needs --zenflow"),
    "zenflow with megatron host offload": (
        lambda d: MOCK + ZENFLOW + ["--optimizer-cpu-offload"],
        "--zenflow and --optimizer-cpu-offload both move optimizer states to the host"),
    "zenflow with precision-aware states": (
        lambda d: MOCK + ZENFLOW + ["--offload-optimizer", "--use-precision-aware-optimizer"],
        "--zenflow keeps its own GPU states"),
    # Megatron-LM flags refused here, by name and by prefix.
    "moe experts": (lambda d: MOCK + ["--num-experts", "8"],
                    "--num-experts: mixture-of-experts (MoE) is not supported here"),
    "moe router flag": (lambda d: MOCK + ["--moe-router-topk=2"],
                        "--moe-router-topk: mixture-of-experts (MoE) is not supported here"),
    "fp8 recipe": (lambda d: MOCK + ["--fp8-format", "hybrid"],
                   "--fp8-format: FP8 is not supported here"),
    "fp4 recipe": (lambda d: MOCK + ["--fp4-format", "e2m1"],
                   "--fp4-format: FP4 is not supported here"),
    # argparse's own errors, one line each.
    "near miss of a flag": (lambda d: MOCK + ["--num-layer", "2"],
                            "unrecognized argument --num-layer (did you mean --num-layers?)"),
    "unknown flag": (lambda d: MOCK + ["--frobnicate"],
                     "unrecognized argument --frobnicate; see --help"),
    "value not a choice": (lambda d: MOCK + ["--normalization", "L2Norm"],
                           "argument --normalization: invalid choice: 'L2Norm'"),
    "value not an integer": (lambda d: MOCK + ["--num-layers", "two"],
                             "argument --num-layers: invalid int value: 'two'"),
    "flag without its value": (lambda d: MOCK + ["--seed"],
                               "argument --seed: expected one argument"),
    "stray value": (lambda d: MOCK + ["0.5"], "unexpected argument '0.5'"),
    # Data and tokenizer flags.
    "data path weight missing": (
        lambda d: ["--data-path", "0.5", "a_text_document", "b_text_document",
                   "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"],
        "--data-path: give either prefixes only, or a weight before every prefix"),
    "data path weight zero": (
        lambda d: ["--data-path", "0", "a_text_document", "1", "b_text_document",
                   "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"],
        "--data-path: weights must be positive"),
    "data path without tokenizer type": (lambda d: ["--data-path", "corpus", "--vocab-size", "9"],
                                         "--data-path needs --tokenizer-type"),
    "null tokenizer without vocab size": (lambda d: tokenizer("NullTokenizer"),
                                          "no vocabulary: give --tokenizer-type"),
    "tokenizer file missing": (
        lambda d: tokenizer("SentencePieceTokenizer", f"{d}/missing.model"),
        "missing.model: file not found"),
    "gpt2 tokenizer without its files": (lambda d: tokenizer("GPT2BPETokenizer"),
                                         "--tokenizer-type GPT2BPETokenizer needs --vocab-file"),
    "gpt2 merge file missing": (
        lambda d: tokenizer("GPT2BPETokenizer", f"{d}/afile", f"{d}/merges.txt"),
        "--merge-file {d}/merges.txt: file not found"),
    "hugging face tokenizer directory missing": (
        lambda d: tokenizer("HuggingFaceTokenizer", f"{d}/llama-tokenizer"),
        "llama-tokenizer: no such tokenizer directory or tokenizer.json"),
    "tiktoken without its pattern": (lambda d: tokenizer("TikTokenizer", f"{d}/afile"),
                                     "--tokenizer-type TikTokenizer needs --tiktoken-pattern"),
    # Tokenizer flags Megatron-LM's tokenizer of the type reads and this project's does not
    # (a flag no tokenizer of the type reads is ignored there and here, with a log line:
    # tests/unit/data/test_tokenizer_flags.py).
    "bpe files for hugging face": (
        lambda d: [*tokenizer("HuggingFaceTokenizer", f"{d}"), "--vocab-file", f"{d}/afile"],
        "--vocab-file with --tokenizer-type HuggingFaceTokenizer: Megatron-LM's tokenizer "
        "reads it, this project's does not"),
    "special tokens for sentencepiece": (
        lambda d: [*tokenizer("SentencePieceTokenizer", f"{d}/afile"),
                   "--tokenizer-special-tokens", "<x>"],
        "--tokenizer-special-tokens with --tokenizer-type SentencePieceTokenizer"),
    # Output paths the run could not create when it gets there.
    "save is a file": (lambda d: MOCK + ["--save", f"{d}/afile"],
                       "--save {d}/afile: is a file; give a directory"),
    "save under a file": (lambda d: MOCK + ["--save", f"{d}/afile/ckpt"],
                          "{d}/afile is a file, so the directory cannot be created there"),
    "metrics path a directory": (lambda d: MOCK + ["--metrics-path", str(d)],
                                 "--metrics-path {d}: is a directory; give a file path"),
    "metrics path under a file": (lambda d: MOCK + ["--metrics-path", f"{d}/afile/m.jsonl"],
                                  "so the file cannot be created there"),
    "tensorboard dir a file": (lambda d: MOCK + ["--tensorboard-dir", f"{d}/afile"],
                               "--tensorboard-dir {d}/afile: is a file"),
    "wandb save dir a file": (lambda d: MOCK + ["--wandb-save-dir", f"{d}/afile"],
                              "--wandb-save-dir {d}/afile: is a file"),
    "profile dir a file": (lambda d: MOCK + ["--profile", "--use-pytorch-profiler",
                                             "--profile-dir", f"{d}/afile"],
                           "--profile-dir {d}/afile: is a file"),
    "data cache path a file": (lambda d: null_data("corpus") + ["--data-cache-path", f"{d}/afile"],
                               "--data-cache-path {d}/afile: is a file"),
}


@pytest.fixture
def flag_dir(tmp_path, monkeypatch):
    """A directory with a file ``afile``; pretrain() must not be reached from these cases."""
    import megatron_ext.training.loop as loop

    def reached(cfg):
        raise AssertionError("the flags were accepted: this case is not a parse-time error")

    monkeypatch.setattr(loop, "pretrain", reached)
    (tmp_path / "afile").write_text("x")
    return tmp_path


@pytest.mark.parametrize("case", sorted(FLAG_CASES))
def test_bad_flags_give_one_line(flag_dir, capsys, case):
    import pretrain_gpt

    make_args, expected = FLAG_CASES[case]
    args = make_args(flag_dir)
    status = pretrain_gpt.main(command_line(args))
    out, err = capsys.readouterr()
    assert_one_error_line(status, out, err, expected.replace("{d}", str(flag_dir)))


# The launch: the parallel layout against the world size (torchrun's rank 0 of 2 here; the
# layout is checked before the rendezvous) and the launcher's variables. These run in this
# process too, through the real pretrain(): the guard below fails a case that gets past the
# checks before anything global (the CPU layer, a process group) is set up.
# Rank 0 of two as a launcher sets it (the cases fail before any rendezvous).
TWO_RANKS = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": "29500"}

LAUNCH_CASES = {
    # (env, expected, argv after BASE)
    "world not divisible by TP x PP": (
        {}, "world size 1 is not divisible by tensor-parallel size 2",
        MOCK + ["--tensor-model-parallel-size", "2"]),
    "global batch not divisible": (
        {}, "--global-batch-size 5 is not divisible by --micro-batch-size 2",
        MOCK + ["--global-batch-size", "5"]),
    "interleaving without a pipeline": (
        {}, "the interleaved schedule (virtual pipeline stages) needs "
            "--pipeline-model-parallel-size >= 2",
        MOCK + ["--num-layers-per-virtual-pipeline-stage", "1"]),
    "step sync not a mode": ({"MEGATRON_EXT_STEP_SYNC": "sometimes"},
                             "MEGATRON_EXT_STEP_SYNC=sometimes: give stream", MOCK),
    "world size not a number": ({"WORLD_SIZE": "two"}, "WORLD_SIZE=two: not an integer", MOCK),
    "rank outside the world": ({"WORLD_SIZE": "2", "RANK": "2"},
                               "RANK=2 WORLD_SIZE=2: the rank must be in [0, WORLD_SIZE)", MOCK),
    "world size without a launcher": (
        {"WORLD_SIZE": "2"}, "WORLD_SIZE=2 without RANK, MASTER_ADDR and MASTER_PORT: each of "
                             "the 2 processes needs its RANK and the address of rank 0", MOCK),
    "world size and rank without an address": (
        {"WORLD_SIZE": "2", "RANK": "0"}, "WORLD_SIZE=2 without MASTER_ADDR and MASTER_PORT: ",
        MOCK),
    "world size and an address without a rank": (
        {"WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
        "WORLD_SIZE=4 without RANK: each of the 4 processes", MOCK),
    "heads not divisible by TP": (
        TWO_RANKS, "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2",
        MOCK + ["--hidden-size", "48", "--num-attention-heads", "3",
                "--tensor-model-parallel-size", "2"]),
    "query groups not divisible by TP": (
        TWO_RANKS, "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2",
        MOCK + ["--group-query-attention", "--num-query-groups", "1",
                "--tensor-model-parallel-size", "2"]),
    "layers not divisible by PP": (
        TWO_RANKS, "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2",
        MOCK + ["--num-layers", "3", "--pipeline-model-parallel-size", "2"]),
    "global batch not divisible by micro x DP": (
        TWO_RANKS, "--global-batch-size 6 is not divisible by --micro-batch-size 2 x "
                   "data-parallel size 2", MOCK + ["--global-batch-size", "6"]),
    "sequence parallel with an odd sequence": (
        TWO_RANKS, "--sequence-parallel: --seq-length 15 is not divisible by "
                   "--tensor-model-parallel-size 2",
        MOCK + ["--seq-length", "15", "--tensor-model-parallel-size", "2",
                "--sequence-parallel"]),
    "interleaving with too few micro-batches": (
        TWO_RANKS, "the interleaved schedule needs a number of micro-batches that is a multiple "
                   "of --pipeline-model-parallel-size 2",
        MOCK + ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                "--num-layers-per-virtual-pipeline-stage", "1"]),
}


@pytest.fixture
def launch_env(monkeypatch):
    """A clean launcher environment, and nothing global set up past the checks."""
    import torch

    from megatron_ext.runtime import cpu_compat

    def reached(*args, **kwargs):
        raise AssertionError("the launch checks passed: this case is not refused")

    for name in [n for n in os.environ if n.startswith(("SLURM_", "TORCHELASTIC_"))] + [
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu_compat, "install", reached)
    monkeypatch.setattr(torch.distributed, "init_process_group", reached)
    return monkeypatch


@pytest.mark.parametrize("case", sorted(LAUNCH_CASES))
def test_bad_launch_gives_one_line(launch_env, capsys, case):
    import pretrain_gpt

    env, expected, args = LAUNCH_CASES[case]
    for name, value in env.items():
        launch_env.setenv(name, value)
    status = pretrain_gpt.main([*BASE, *args])
    out, err = capsys.readouterr()
    assert_one_error_line(status, out, err, expected)


# Cases that need the run to start, and a few of FLAG_CASES' kinds as real processes.
CASES = {
    # Parse-time errors through the real process: bounds, nan, a combination, a refused
    # Megatron-LM flag, argparse's near miss, a required flag, a run id that climbs out.
    "lr nan": (lambda d: MOCK + ["--lr", "nan"], "--lr nan: must be a finite number"),
    "offload host cache nan": (lambda d: MOCK + OFFLOAD + ["--offload-host-cache-gb", "nan"],
                               "--offload-host-cache-gb nan: must be a finite number"),
    "bf16 and fp16": (lambda d: MOCK + ["--bf16", "--fp16"], "--bf16 and --fp16 are exclusive"),
    "fp8 flag": (lambda d: MOCK + ["--fp8-param-gather"],
                 "--fp8-param-gather: FP8 is not supported here"),
    "near miss of a flag": (lambda d: MOCK + ["--lr-warmup-iter", "2"],
                            "(did you mean --lr-warmup-iters?)"),
    "missing --seq-length": (lambda d: without("--seq-length", *MOCK),
                             "--seq-length is required"),
    "offload run id climbs out": (lambda d: MOCK + OFFLOAD + ["--offload-run-id", "../../x"],
                                  "--offload-run-id '../../x': a run id is one directory name"),
    "save under a file": (lambda d: MOCK + ["--save", f"{d}/garbage.bin/ckpt"],
                          "garbage.bin is a file, so the directory cannot be created there"),
    # Data files.
    "missing data prefix": (lambda d: null_data(f"{d}/nope"), "nope.idx not found"),
    "data prefix with its .bin suffix": (lambda d: null_data(f"{d}/ok.bin"),
                                         "give the prefix without .bin/.idx"),
    "data prefix is not a regular file": (lambda d: null_data(f"{d}/dirbin"),
                                          "is not a regular file"),
    "unreadable index": (lambda d: null_data(f"{d}/garbage"), "is not a megatron-core index"),
    "tokenizer file not a model": (
        lambda d: ["--data-path", f"{d}/ok", "--tokenizer-type", "SentencePieceTokenizer",
                   "--tokenizer-model", f"{d}/fake.model"], "not a SentencePiece model"),
    "data vocab larger than tokenizer": (
        lambda d: null_data(f"{d}/bigvocab"),
        "bigvocab.bin holds token id 500, outside the vocabulary of 101 ids of --tokenizer-type "
        "NullTokenizer: give --tokenizer-type"),
    "truncated bin": (lambda d: null_data(f"{d}/truncbin"),
                      "truncbin.bin has 3990 bytes, its index describes 4000"),
    "index points past the bin": (lambda d: null_data(f"{d}/pastbin"),
                                  "the .bin is truncated or the pair does not belong together"),
    "bin and index of two corpora": (lambda d: null_data(f"{d}/foreign"),
                                     "the .bin is longer or the pair does not belong together"),
    "truncated index": (lambda d: null_data(f"{d}/truncidx"), "truncidx.idx is truncated"),
    "bad split": (lambda d: null_data(f"{d}/ok") + ["--split", "a,b"], "--split 'a,b'"),
    "split without training data": (lambda d: null_data(f"{d}/ok") + ["--split", "0,1,0"],
                                    "the training split is empty"),
    "skip train with an empty validation split": (
        lambda d: null_data(f"{d}/ok") + ["--split", "100,0,0", "--skip-train",
                                          "--eval-iters", "1"],
        "validation split is empty (--split 100,0,0): there is nothing to evaluate"),
    "small corpus with the default split": (
        lambda d: null_data(f"{d}/small"), "the test split of"),
    "megatron host offload on cpu": (
        lambda d: MOCK + ["--optimizer-cpu-offload", "--use-distributed-optimizer"],
        "needs a GPU"),
    # Checkpoints.
    "load without checkpoint": (lambda d: MOCK + ["--load", f"{d}/empty_ckpt"],
                                "no checkpoint there"),
    "pointer not ascii": (lambda d: MOCK + ["--load", f"{d}/ptr_nonascii"],
                          "not an iteration number"),
    "pointer not utf-8": (lambda d: MOCK + ["--load", f"{d}/ptr_badutf8"],
                          "not an iteration number"),
    "pointer of a release checkpoint": (lambda d: MOCK + ["--load", f"{d}/ptr_release"],
                                        "holds 'release', not an iteration number"),
    "pointer to a missing iteration": (
        lambda d: MOCK + ["--load", f"{d}/ptr_no_iter"],
        "latest_checkpointed_iteration.txt names iteration 7 but"),
    "iteration directory empty": (
        lambda d: MOCK + ["--load", f"{d}/ptr_empty_iter"],
        "the checkpoint is damaged or not a torch_dist checkpoint"),
    "checkpoint of another shape": (
        lambda d: MOCK + OFFLOAD + ["--load", f"{d}/good_ckpt", "--num-layers", "3",
                                    "--hidden-size", "128"],
        "--num-layers 2 (this run: 3); --hidden-size 64 (this run: 128)"),
    "checkpoint of another vocabulary": (
        lambda d: ["--mock-data", "--vocab-size", "300", *OFFLOAD, "--load", f"{d}/good_ckpt"],
        "padded vocabulary 128 (this run: 384"),
    "zenflow resume of an offload checkpoint": (
        lambda d: MOCK + ZENFLOW + ["--load", f"{d}/good_ckpt", "--train-iters", "4"],
        "saved by --offload-optimizer and this run uses --zenflow"),
    "offload corrupt checkpoint state": (
        lambda d: MOCK + OFFLOAD + ["--load", f"{d}/offload_ckpt", "--train-iters", "4"],
        "checksum"),
    # Offload tiers.
    "offload cache too small": (
        lambda d: MOCK + OFFLOAD + ["--offload-paths", f"{d}@1,1", "--offload-subgroup-size",
                                    "10000", "--offload-host-cache-gb", "0.0001"],
        "the pipeline needs 3"),
    "offload no host cache and no paths": (
        lambda d: MOCK + OFFLOAD + ["--offload-host-cache-gb", "0"],
        "in host memory and there is no --offload-paths for them: give --offload-paths DIR, "
        "or a positive --offload-host-cache-gb (or auto)"),
    "offload directory a planted symlink": (
        lambda d: MOCK + OFFLOAD + ["--offload-paths", _planted_offload_path(d) + "@1,1"],
        "is a symlink: refusing to follow it"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_gives_one_line(data, case):
    make_args, expected = CASES[case]
    proc = subprocess.run([sys.executable, PRETRAIN, *command_line(make_args(data))], cwd=ROOT,
                          env=test_env(), capture_output=True, text=True, timeout=120)
    assert_one_error_line(proc.returncode, proc.stdout, proc.stderr, expected)


ENV_CASES = {
    # (env, expected, flags instead of MOCK + ZENFLOW); TWO_RANKS: see LAUNCH_CASES
    "zenflow threads not a number": ({"MEGATRON_EXT_ZENFLOW_THREADS": "many"},
                                     "MEGATRON_EXT_ZENFLOW_THREADS=many: give a whole number"),
    "zenflow no staging slot": ({"MEGATRON_EXT_ZENFLOW_STAGING_SLOTS": "0"},
                                "MEGATRON_EXT_ZENFLOW_STAGING_SLOTS=0: give a whole number"),
    "zenflow cpus not a list": ({"MEGATRON_EXT_ZENFLOW_CPUS": "fast"},
                                "MEGATRON_EXT_ZENFLOW_CPUS=fast: give CPU numbers and ranges"),
    "zenflow cpus not available": ({"MEGATRON_EXT_ZENFLOW_CPUS": "0-4095"},
                                   "are not available to this process"),
    "zenflow free memory hook not bytes": ({"MEGATRON_EXT_ZENFLOW_DEVICE_FREE_BYTES": "1GB"},
                                           "MEGATRON_EXT_ZENFLOW_DEVICE_FREE_BYTES=1GB: give a "
                                           "number of bytes"),
    "offload run id from torchrun climbs out": (
        {"SLURM_JOB_ID": "", "TORCHELASTIC_RUN_ID": "../../etc"},
        "TORCHELASTIC_RUN_ID '../../etc': a run id is one directory name", MOCK + OFFLOAD),
    "offload run id from slurm with a slash": (
        {"SLURM_JOB_ID": "12/3"}, "SLURM_JOB_ID '12/3': a run id is one directory name",
        MOCK + OFFLOAD),
    "offload stream share hook not a number": (
        {"MEGATRON_EXT_OFFLOAD_STREAM_SHARE": "half"},
        "MEGATRON_EXT_OFFLOAD_STREAM_SHARE=half: give a number >= 0", MOCK + OFFLOAD),
    "device memory hook not a number": (
        {"MEGATRON_EXT_DEVICE_MEMORY_LIMIT_GB": "lots"},
        "MEGATRON_EXT_DEVICE_MEMORY_LIMIT_GB=lots: give a number >= 0",
        MOCK + OFFLOAD + ["--offload-device-cache-gb", "auto"]),
    "checkpoint fault hook malformed": (
        {"MEGATRON_EXT_CHECKPOINT_FAULT": "enospc:last"},
        "MEGATRON_EXT_CHECKPOINT_FAULT=enospc:last: give enospc:ITERATION",
        MOCK + ["--save", "{tmp}/ckpt"]),
    "heads not divisible by TP": (
        TWO_RANKS, "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2",
        MOCK + ["--hidden-size", "48", "--num-attention-heads", "3",
                "--tensor-model-parallel-size", "2"]),
    "save disk too small for one checkpoint": (
        {"MEGATRON_EXT_SAVE_FREE_GB": "0.0001"},
        "GB free: free space there, or give --save a directory on a larger disk",
        MOCK + ["--save", "{tmp}/ckpt"]),
}


@pytest.mark.parametrize("case", sorted(ENV_CASES))
def test_bad_environment_gives_one_line(tmp_path, case):
    env, expected, *flags = ENV_CASES[case]
    args = [a.replace("{tmp}", str(tmp_path)) for a in (flags[0] if flags else MOCK + ZENFLOW)]
    proc = subprocess.run([sys.executable, PRETRAIN, *BASE, *args], cwd=ROOT,
                          env=test_env(env), capture_output=True, text=True, timeout=120)
    assert_one_error_line(proc.returncode, proc.stdout, proc.stderr, expected)


def test_second_job_with_the_same_run_id(tmp_path):
    """A job whose run id a running job holds (here: this test process) refuses to start."""
    import socket

    from megatron_ext.offload.jobdir import JobDirs

    held = JobDirs([str(tmp_path)], "shared", rank=0)
    try:
        proc = subprocess.run([sys.executable, PRETRAIN, *BASE, *MOCK, *OFFLOAD,
                               "--offload-paths", f"{tmp_path}@1,1", "--offload-run-id", "shared"],
                              cwd=ROOT, env=test_env(), capture_output=True, text=True,
                              timeout=120)
    finally:
        held.close()
    assert_one_error_line(proc.returncode, proc.stdout, proc.stderr,
                          f"is in use by another running job (host {socket.gethostname()}, "
                          f"pid {os.getpid()}) with the same run id 'shared'")


def _planted_offload_path(d) -> str:
    """An offload path whose megatron_ext-USER is someone's symlink to a directory of theirs."""
    from megatron_ext.offload.jobdir import user_name

    path = d / "planted"
    if not path.exists():
        path.mkdir()
        (d / "decoy").mkdir()
        (path / f"megatron_ext-{user_name()}").symlink_to(d / "decoy")
    return str(path)
