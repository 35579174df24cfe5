"""Each bad input gives one line on stderr, exit status 2, and no traceback."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

from mext_testing import PRETRAIN, ROOT, test_env, write_indexed_dataset

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2",
        "--device", "cpu", "--wandb-mode", "disabled", "--eval-iters", "0",
        "--max-position-embeddings", "16", "--lr", "1e-3", "--num-workers", "0"]
MOCK = ["--mock-data", "--vocab-size", "100"]
OFFLOAD = ["--use-distributed-optimizer", "--offload-optimizer"]
ZENFLOW = ["--use-distributed-optimizer", "--zenflow"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
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
    # A checkpoint with offloaded optimizer state, one byte of which is then flipped.
    subprocess.run([sys.executable, PRETRAIN, *BASE, *MOCK, *OFFLOAD,
                    "--save", str(root / "offload_ckpt")], cwd=ROOT, env=test_env(), check=True,
                   capture_output=True, timeout=120)
    shutil.copytree(root / "offload_ckpt", root / "good_ckpt")
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
    for name, text in (("ptr_nonascii", "\u0663".encode()), ("ptr_badutf8", b"\xff\xfe3")):
        (root / name).mkdir()
        (root / name / "latest_checkpointed_iteration.txt").write_bytes(text)


def null_data(prefix):
    return ["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


CASES = {
    "missing data prefix": (lambda d: null_data(f"{d}/nope"), "nope.idx not found"),
    "data prefix is not a regular file": (lambda d: null_data(f"{d}/dirbin"),
                                          "is not a regular file"),
    "unreadable index": (lambda d: null_data(f"{d}/garbage"), "is not a megatron-core index"),
    "tokenizer file missing": (
        lambda d: ["--data-path", f"{d}/ok", "--tokenizer-type", "SentencePieceTokenizer",
                   "--tokenizer-model", f"{d}/missing.model"], "missing.model: file not found"),
    "tokenizer file not a model": (
        lambda d: ["--data-path", f"{d}/ok", "--tokenizer-type", "SentencePieceTokenizer",
                   "--tokenizer-model", f"{d}/fake.model"], "not a SentencePiece model"),
    "data vocab larger than tokenizer": (lambda d: null_data(f"{d}/bigvocab"),
                                         "token id 500 is outside the tokenizer's vocabulary"),
    "hidden not divisible by heads": (
        lambda d: MOCK + ["--num-attention-heads", "5"],
        "--hidden-size 64 is not divisible by --num-attention-heads 5"),
    "world not divisible by TP x PP": (lambda d: MOCK + ["--tensor-model-parallel-size", "2"],
                                       "world size 1 is not divisible by tensor-parallel size 2"),
    "global batch not divisible": (
        lambda d: MOCK + ["--global-batch-size", "5"],
        "--global-batch-size 5 is not divisible by --micro-batch-size 2"),
    "load without checkpoint": (lambda d: MOCK + ["--load", f"{d}/empty_ckpt"],
                                "no checkpoint there"),
    "bf16 and fp16": (lambda d: MOCK + ["--bf16", "--fp16"], "--bf16 and --fp16 are exclusive"),
    "mock and data path": (lambda d: MOCK + ["--data-path", f"{d}/ok"], "are exclusive"),
    "no data": (lambda d: ["--vocab-size", "100"], "no training data"),
    "param gather without distributed optimizer": (
        lambda d: MOCK + ["--overlap-param-gather"], "needs --use-distributed-optimizer"),
    "megatron host offload on cpu": (
        lambda d: MOCK + ["--optimizer-cpu-offload", "--use-distributed-optimizer"],
        "needs a GPU"),
    "bad split": (lambda d: null_data(f"{d}/ok") + ["--split", "a,b"], "--split 'a,b'"),
    "finetune without load": (lambda d: MOCK + ["--finetune"], "--finetune needs --load"),
    "negative lr": (lambda d: MOCK + ["--lr", "-1"], "--lr must be positive"),
    "offload paths without offload": (lambda d: MOCK + ["--offload-paths", str(d)],
                                      "--offload-paths needs --offload-optimizer"),
    "offload without distributed optimizer": (lambda d: MOCK + ["--offload-optimizer"],
                                              "add --use-distributed-optimizer"),
    "offload path missing": (
        lambda d: MOCK + OFFLOAD + ["--offload-paths", f"{d}/no-such-dir"], "no-such-dir"),
    "offload path given twice": (
        lambda d: MOCK + OFFLOAD + ["--offload-paths", f"{d}@1,1", f"{d}/."],
        "the same directory"),
    "offload bandwidth not a number": (
        lambda d: MOCK + OFFLOAD + ["--offload-paths", f"{d}@fast,2"],
        "bandwidths must be positive numbers"),
    "offload cache too small": (
        lambda d: MOCK + OFFLOAD + ["--offload-paths", f"{d}@1,1", "--offload-subgroup-size",
                                    "10000", "--offload-host-cache-gb", "0.0001"],
        "the pipeline needs 3"),
    "offload corrupt checkpoint state": (
        lambda d: MOCK + OFFLOAD + ["--load", f"{d}/offload_ckpt", "--train-iters", "4"],
        "checksum"),
    "profile range backwards": (lambda d: MOCK + ["--profile", "--profile-step-start", "5",
                                                  "--profile-step-end", "3"],
                                "--profile needs 0 <= --profile-step-start < --profile-step-end"),
    "zenflow without distributed optimizer": (lambda d: MOCK + ["--zenflow"],
                                              "add --use-distributed-optimizer"),
    "zenflow ratio out of range": (lambda d: MOCK + ZENFLOW + ["--zenflow-topk-ratio", "0"],
                                   "--zenflow-topk-ratio 0.0: must be in (0, 1]"),
    "zenflow interval not a number": (
        lambda d: MOCK + ZENFLOW + ["--zenflow-update-interval", "often"],
        "give a number of steps or auto"),
    "zenflow selection more often than updates": (
        lambda d: MOCK + ZENFLOW + ["--zenflow-select-interval", "2"],
        "shorter than --zenflow-update-interval 4"),
    "zenflow flag without zenflow": (lambda d: MOCK + ["--zenflow-topk-ratio", "0.2"],
                                     "--zenflow-topk-ratio needs --zenflow"),
    "lr nan": (lambda d: MOCK + ["--lr", "nan"], "--lr nan: must be a finite number"),
    "offload host cache nan": (lambda d: MOCK + OFFLOAD + ["--offload-host-cache-gb", "nan"],
                               "--offload-host-cache-gb nan: must be a finite number"),
    "offload host cache inf": (lambda d: MOCK + OFFLOAD + ["--offload-host-cache-gb", "inf"],
                               "--offload-host-cache-gb inf: must be a finite number"),
    "pointer not ascii": (lambda d: MOCK + ["--load", f"{d}/ptr_nonascii"],
                          "not an iteration number"),
    "pointer not utf-8": (lambda d: MOCK + ["--load", f"{d}/ptr_badutf8"],
                          "not an iteration number"),
    "checkpoint of another shape": (
        lambda d: MOCK + OFFLOAD + ["--load", f"{d}/good_ckpt", "--num-layers", "3",
                                    "--hidden-size", "128"],
        "--num-layers 2 (this run: 3); --hidden-size 64 (this run: 128)"),
    "checkpoint of another vocabulary": (
        lambda d: ["--mock-data", "--vocab-size", "300", *OFFLOAD, "--load", f"{d}/good_ckpt"],
        "padded vocabulary 128 (this run: 384"),
    "use checkpoint args without load": (lambda d: MOCK + ["--use-checkpoint-args"],
                                         "--use-checkpoint-args needs --load"),
    "truncated bin": (lambda d: null_data(f"{d}/truncbin"),
                      "truncbin.bin has 3990 bytes, its index describes 4000"),
    "index points past the bin": (lambda d: null_data(f"{d}/pastbin"),
                                  "the .bin is truncated or the pair does not belong together"),
    "bin and index of two corpora": (lambda d: null_data(f"{d}/foreign"),
                                     "the .bin is longer or the pair does not belong together"),
    "truncated index": (lambda d: null_data(f"{d}/truncidx"), "truncidx.idx is truncated"),
    "small corpus with the default split": (
        lambda d: null_data(f"{d}/small"), "the test split of"),
    "zenflow resume of an offload checkpoint": (
        lambda d: MOCK + ZENFLOW + ["--load", f"{d}/good_ckpt", "--train-iters", "4"],
        "saved by --offload-optimizer and this run uses --zenflow"),
    "offload run id an absolute path": (
        lambda d: MOCK + OFFLOAD + ["--offload-run-id", f"{d}/elsewhere"],
        "a run id is one directory name"),
    "offload run id climbs out": (lambda d: MOCK + OFFLOAD + ["--offload-run-id", "../../x"],
                                  "--offload-run-id '../../x': a run id is one directory name"),
    "offload directory a planted symlink": (
        lambda d: MOCK + OFFLOAD + ["--offload-paths", _planted_offload_path(d) + "@1,1"],
        "is a symlink: refusing to follow it"),
    "skip train without evaluation": (lambda d: MOCK + ["--skip-train"],
                                      "--skip-train only evaluates: give --eval-iters N > 0"),
    "negative train iters": (lambda d: MOCK + ["--train-iters", "-1"],
                             "--train-iters must be >= 0"),
    "precision-aware optimizer without offload": (
        lambda d: MOCK + ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16"],
        "honoured by --offload-optimizer only"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_gives_one_line(data, case):
    make_args, expected = CASES[case]
    proc = subprocess.run([sys.executable, PRETRAIN, *BASE, *make_args(data)], cwd=ROOT,
                          env=test_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), proc.stderr
    assert expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


ENV_CASES = {
    "zenflow threads not a number": ({"MEGATRON_EXT_ZENFLOW_THREADS": "many"},
                                     "MEGATRON_EXT_ZENFLOW_THREADS=many: give a whole number"),
    "zenflow no staging slot": ({"MEGATRON_EXT_ZENFLOW_STAGING_SLOTS": "0"},
                                "MEGATRON_EXT_ZENFLOW_STAGING_SLOTS=0: give a whole number"),
    "zenflow cpus not a list": ({"MEGATRON_EXT_ZENFLOW_CPUS": "fast"},
                                "MEGATRON_EXT_ZENFLOW_CPUS=fast: give CPU numbers and ranges"),
    "zenflow cpus not available": ({"MEGATRON_EXT_ZENFLOW_CPUS": "0-4095"},
                                   "are not available to this process"),
    "step sync not a mode": ({"MEGATRON_EXT_STEP_SYNC": "sometimes"},
                             "MEGATRON_EXT_STEP_SYNC=sometimes: give stream"),
    # (env, expected, flags instead of ZENFLOW's)
    "offload run id from torchrun climbs out": (
        {"SLURM_JOB_ID": "", "TORCHELASTIC_RUN_ID": "../../etc"},
        "TORCHELASTIC_RUN_ID '../../etc': a run id is one directory name", MOCK + OFFLOAD),
}


@pytest.mark.parametrize("case", sorted(ENV_CASES))
def test_bad_environment_gives_one_line(case):
    env, expected, *flags = ENV_CASES[case]
    proc = subprocess.run([sys.executable, PRETRAIN, *BASE, *(flags[0] if flags else
                                                              MOCK + ZENFLOW)], cwd=ROOT,
                          env=test_env(env), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def _planted_offload_path(d) -> str:
    """An offload path whose megatron_ext-USER is someone's symlink to a directory of theirs."""
    from megatron_ext.offload.jobdir import user_name

    path = d / "planted"
    if not path.exists():
        path.mkdir()
        (d / "decoy").mkdir()
        (path / f"megatron_ext-{user_name()}").symlink_to(d / "decoy")
    return str(path)
