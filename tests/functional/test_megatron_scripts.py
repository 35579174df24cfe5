"""Megatron-LM's own example scripts, as their text, run here (shapes shrunk) or are refused.

The scripts are Megatron-LM's files, copied verbatim from tags core_v0.16.1 and
core_v0.19.0 into ``tests/data/megatron_lm_examples/<tag>/<path>`` (see the README
there): the dense GPT ones (examples/gpt3, examples/llama, the dense Llama of
examples/megatron_fsdp) and, as refusal cases, MoE ones (examples/mixtral,
examples/gptoss). Each case runs a script with bash, as it is written, after a small table
of substitutions of sizes (layers, hidden size, heads, sequence, batch, iterations,
intervals, parallel sizes); the paths come in as the script's own arguments. ``torchrun``,
``python`` and ``uv`` on the script's PATH record their arguments instead of running, so
the flags pretrain_gpt.py gets are exactly the ones bash gives it: its arrays, branches,
quoting and word splitting (``"--split '99,1,0'"`` inside an array reaches the program as
``--split`` and ``'99,1,0'``, quotes included).

Then a case either trains 3 iterations in a real pretrain_gpt.py process on the CPU, or is
refused in exactly one line: the refused-flags table's line for the first refused flag
(``megatron_ext/config/megatron_compat.py``, the table the README and docs/flags.md are
generated from). Two scripts are refused by Megatron-LM itself (examples/gpt3 at both
tags); they are refused here too, and their runnable remainder is a case of its own, with
the one line that Megatron-LM refuses deleted (``drop``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import numpy as np
import pytest
import tokenizer_files as tf

import pretrain_gpt
from megatron_ext.config import build_parser, parse_config
from megatron_ext.config.megatron_compat import first_refused, refusal, value_refusal
from megatron_ext.errors import UsageError
from mext_testing import ROOT, read_metrics, run_pretrain, write_indexed_dataset

EXAMPLES = ROOT / "tests" / "data" / "megatron_lm_examples"

# What the scripts do not say and a CPU test needs: this project's flags only.
LOCAL = ["--device", "cpu", "--wandb-mode", "disabled"]

# Sizes of the scripts -> a CPU's. Each left side must occur in the script (as a whole
# value); a script's table is the union of the groups it uses.
GPT3_SIZES = {
    "--num-layers 96": "--num-layers 2", "--hidden-size 12288": "--hidden-size 64",
    "--num-attention-heads 96": "--num-attention-heads 4",
    "--seq-length 2048": "--seq-length 32",
    "--max-position-embeddings 2048": "--max-position-embeddings 32",
    "--global-batch-size 1536": "--global-batch-size 2",
    "--train-iters 500000": "--train-iters 3", "--lr-decay-iters 430000": "--lr-decay-iters 3",
    "--tensor-model-parallel-size 8": "--tensor-model-parallel-size 1",
    "--pipeline-model-parallel-size 16": "--pipeline-model-parallel-size 1",
    "--log-interval 100": "--log-interval 1", "--save-interval 10000": "--save-interval 2",
    "--eval-interval 1000": "--eval-interval 2", "--eval-iters 10": "--eval-iters 1",
}
LLAMA_SIZES = {
    "NUM_LAYERS=32": "NUM_LAYERS=2", "SEQ_LENGTH=8192": "SEQ_LENGTH=32",
    "MAX_POSITION_EMBEDDINGS=8192": "MAX_POSITION_EMBEDDINGS=32",
    "GLOBAL_BATCH_SIZE=128": "GLOBAL_BATCH_SIZE=4",
    "--hidden-size 4096": "--hidden-size 64", "--ffn-hidden-size 14336": "--ffn-hidden-size 224",
    "--num-attention-heads 32": "--num-attention-heads 4",
    "--num-query-groups 8": "--num-query-groups 2", "--kv-channels 128": "--kv-channels 16",
    # Sample-based, as the script: 12 samples = 3 iterations of 4.
    "--train-samples 1953125000": "--train-samples 12",
    "--lr-decay-samples 1949218748": "--lr-decay-samples 12",
    "--lr-warmup-samples 3906252": "--lr-warmup-samples 4",
    "--vocab-size 128256": "--vocab-size 128",
    "--eval-iters 32": "--eval-iters 1", "--eval-interval 100": "--eval-interval 2",
    "--save-interval 1000": "--save-interval 2",
}
LLAMA_PROFILE = {"--profile-step-start 4": "--profile-step-start 2",
                 "--profile-step-end 6": "--profile-step-end 3"}

# The llama scripts' precision switch (their DTYPE variable): fp8 as written, refused by
# the table; bf16 is the script's other branch.
BF16 = {'DTYPE="fp8"': 'DTYPE="bf16"'}


@dataclasses.dataclass
class Case:
    """One run of one script: its substitutions, arguments, environment, and outcome."""

    id: str
    tag: str
    path: str
    sizes: Dict[str, str]
    args: Callable[[Path], List[str]] = lambda tmp: []
    switches: Dict[str, str] = dataclasses.field(default_factory=dict)
    env: Dict[str, str] = dataclasses.field(default_factory=dict)
    # Lines deleted (each holds this text): what Megatron-LM itself refuses in the script.
    drop: Tuple[str, ...] = ()
    # None: trains. A flag: refused by the table's line for it. Other text: refused by a
    # rule Megatron-LM has too, in a line that starts with it.
    refused: str = None
    # Whether every flag of the script is one the parser knows or the table refuses.
    all_flags_known: bool = True

    def text(self) -> str:
        """The script as run: the file with the substitutions and deletions applied."""
        text = (EXAMPLES / self.tag / self.path).read_text()
        for old, new in {**self.sizes, **self.switches}.items():
            # A whole value: "--eval-iters 10" is not the start of "--eval-iters 100".
            pattern = re.escape(old) + r"(?![\w.])"
            assert re.search(pattern, text), f"{self.id}: {old!r} is not in the script"
            text = re.sub(pattern, new, text)
        for line in self.drop:
            kept = [x for x in text.splitlines(keepends=True) if line not in x]
            assert len(kept) == len(text.splitlines()) - 1, f"{self.id}: {line!r} not one line"
            text = "".join(kept)
        return text


def gpt3_args(tmp: Path) -> List[str]:
    """CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATA_PATH."""
    return [str(tmp / "ckpt"), str(tmp / "tb"), str(tmp / "gpt2" / "vocab.json"),
            str(tmp / "gpt2" / "merges.txt"), str(tmp / "corpus_text_document")]


def llama_args(tmp: Path) -> List[str]:
    """CHECKPOINT_PATH TENSORBOARD_LOGS_PATH, the tokenizer and data left MOCK."""
    return [str(tmp / "ckpt"), str(tmp / "tb")]


def llama_real_args(tmp: Path) -> List[str]:
    """The real-data branch: a Hugging Face tokenizer directory and a data prefix."""
    return [str(tmp / "ckpt"), str(tmp / "tb"), str(tmp / "hf"), str(tmp / "corpus_text_document")]


def fsdp_args(tmp: Path) -> List[str]:
    """CHECKPOINT_PATH, the data and tokenizer left MOCK."""
    return [str(tmp / "ckpt")]


GPT3 = "examples/gpt3/train_gpt3_175b_distributed.sh"
LLAMA = "examples/llama/train_llama3_8b_h100_fp8.sh"
MIXTRAL = "examples/mixtral/train_mixtral_8x7b_distributed.sh"
FSDP_LLAMA = "examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh"
GPTOSS = "examples/gptoss/02_train.sh"
V16, V19 = "core_v0.16.1", "core_v0.19.0"
LLAMA_ALL = {**LLAMA_SIZES, **LLAMA_PROFILE}

CASES = [
    # Megatron-LM asserts "expected no batch-size rampup for iteration-based training".
    Case("gpt3-v16", V16, GPT3, GPT3_SIZES, gpt3_args,
         refused="--rampup-batch-size needs sample-based training"),
    Case("gpt3-v16-without-rampup", V16, GPT3, GPT3_SIZES, gpt3_args,
         drop=("--rampup-batch-size 16 16 5859375",)),
    # Megatron-LM raises "Cannot specify both --step-batch-size-schedule and
    # --global-batch-size" (and its schedule reaches it word-split).
    Case("gpt3-v19", V19, GPT3, GPT3_SIZES, gpt3_args, refused="--step-batch-size-schedule"),
    Case("gpt3-v19-without-schedule", V19, GPT3, GPT3_SIZES, gpt3_args,
         drop=("--step-batch-size-schedule",)),
    Case("llama-v16", V16, LLAMA, LLAMA_ALL, llama_args, refused="--fp8-format"),
    Case("llama-v16-bf16", V16, LLAMA, LLAMA_ALL, llama_args, BF16),
    Case("llama-v16-bf16-real-data", V16, LLAMA, LLAMA_ALL, llama_real_args, BF16),
    # Its checkpoint lines dropped (--save, and --load of the same directory, which here
    # starts from scratch only as --save's): --save-interval stays and saves nothing, as
    # there.
    Case("llama-v16-bf16-without-save", V16, LLAMA, LLAMA_ALL, llama_args, BF16,
         drop=('--save "$CHECKPOINT_PATH"', '--load "$CHECKPOINT_PATH"')),
    Case("llama-v19", V19, LLAMA, LLAMA_ALL, llama_args, refused="--fp8-format"),
    Case("llama-v19-bf16", V19, LLAMA, LLAMA_ALL, llama_args, BF16),
    Case("llama-v19-bf16-real-data", V19, LLAMA, LLAMA_ALL, llama_real_args, BF16),
    # Dense Llama on Megatron FSDP, fp8: refused by the FSDP rows, and without FSDP (its
    # USE_MEGATRON_FSDP switch) by the FP8 rows. Its flags outside FSDP and FP8 are not
    # all known (--no-check-for-nan-in-loss-and-grad, --logging-level): refused first.
    Case("fsdp-llama-v19", V19, FSDP_LLAMA, LLAMA_SIZES, fsdp_args,
         refused="--use-megatron-fsdp", all_flags_known=False),
    Case("fsdp-llama-v19-ddp", V19, FSDP_LLAMA, LLAMA_SIZES, fsdp_args,
         env={"USE_MEGATRON_FSDP": "0"}, refused="--fp8-format", all_flags_known=False),
    # MoE: refused by the MoE rows, whatever else they hold.
    Case("mixtral-v16", V16, MIXTRAL, {}, lambda tmp: [str(tmp / "ckpt"), str(tmp / "tok.model"),
                                                      str(tmp / "corpus_text_document")],
         refused="--num-experts", all_flags_known=False),
    Case("mixtral-v19", V19, MIXTRAL, {}, lambda tmp: [str(tmp / "ckpt"), str(tmp / "tok.model"),
                                                      str(tmp / "corpus_text_document")],
         refused="--num-experts", all_flags_known=False),
    Case("gptoss-v19", V19, GPTOSS, {}, lambda tmp: ["--checkpoint-path", str(tmp / "ckpt")],
         refused="--num-experts", all_flags_known=False),
]
BY_ID = {case.id: case for case in CASES}

_RECORDER = '#!/bin/sh\nfor a in "$@"; do printf "%s\\0" "$a"; done > "$RECORD_DIR/$$"\n'


def script_argv(case: Case, tmp: Path) -> List[str]:
    """The flags the script gives pretrain_gpt.py: bash runs it, a recorder is the launcher."""
    bin_dir, records = tmp / "bin", tmp / "records"
    bin_dir.mkdir(exist_ok=True)
    records.mkdir(exist_ok=True)
    for name in ("torchrun", "python", "uv"):
        (bin_dir / name).write_text(_RECORDER)
        (bin_dir / name).chmod(0o755)
    # The scripts check that they run from a Megatron-LM checkout (./pretrain_gpt.py).
    (tmp / "pretrain_gpt.py").touch()
    (tmp / "ckpt").mkdir(exist_ok=True)
    script = tmp / f"{case.id}.sh"
    script.write_text(case.text())
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp),
           "RECORD_DIR": str(records), **case.env}
    out = subprocess.run(["bash", str(script), *case.args(tmp)], cwd=tmp, env=env,
                         capture_output=True, text=True, timeout=60)
    launches = [f.read_bytes().split(b"\0")[:-1] for f in sorted(records.iterdir())]
    assert out.returncode == 0 and len(launches) == 1, (out.stdout, out.stderr)
    argv = [a.decode() for a in launches[0]]
    script_at = [i for i, a in enumerate(argv) if a.endswith("pretrain_gpt.py")]
    assert len(script_at) == 1, argv
    for record in records.iterdir():
        record.unlink()
    return argv[script_at[0] + 1:]


def _known_options() -> set:
    return {opt for action in build_parser()._actions for opt in action.option_strings}


def test_every_script_and_tag_has_a_case():
    scripts = {str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.sh")}
    assert scripts == {f"{case.tag}/{case.path}" for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_script_parses_or_is_refused_by_the_table(tmp_path, capsys, case):
    _files(tmp_path)
    argv = script_argv(case, tmp_path)
    flags = [a.split("=", 1)[0] for a in argv if a.startswith("--")]
    if case.all_flags_known:
        known = _known_options()
        assert not [f for f in flags if f not in known and not refusal(f)]
    if case.refused is None:
        assert first_refused(argv) is None
        parse_config([*argv, *LOCAL])  # the whole command: nothing missing, nothing refused
        return
    # The entry point itself, in-process: a refusal never gets past parsing.
    assert pretrain_gpt.main([*argv, *LOCAL]) == UsageError.exit_code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    if case.refused.startswith("--") and " " not in case.refused:
        # The table's one line for the first refused flag of the script, as written there.
        why = refusal(case.refused)
        assert why is not None and case.refused in flags
        assert lines == [f"error: {case.refused}: {why}"], captured.err
    else:
        assert len(lines) == 1 and lines[0].startswith(f"error: {case.refused}"), captured.err
    assert "Traceback" not in captured.out + captured.err


def test_quoted_split_reaches_the_program_with_its_quotes(tmp_path):
    # "--split '99,1,0'" in a double-quoted array element, expanded unquoted: bash splits
    # the words and keeps the single quotes; megatron-core reads the numbers, and so does
    # the config.
    argv = script_argv(BY_ID["llama-v16-bf16"], tmp_path)
    assert argv[argv.index("--split") + 1] == "'99,1,0'"
    cfg = parse_config([*argv, *LOCAL])
    assert cfg.data.split == "'99,1,0'"
    from megatron.core.datasets.blended_megatron_dataset_config import (
        parse_and_normalize_split,
    )

    assert parse_and_normalize_split(cfg.data.split) == [0.99, 0.01, 0.0]


def test_the_v19_gpt3_remainder_is_the_v16_one(tmp_path):
    # Both tags' gpt3 scripts, less the line Megatron-LM refuses in each: the same flags,
    # so one of them trains below.
    _files(tmp_path)
    assert script_argv(BY_ID["gpt3-v16-without-rampup"], tmp_path) == \
        script_argv(BY_ID["gpt3-v19-without-schedule"], tmp_path)


def _files(tmp: Path) -> None:
    """The files the scripts' arguments name: GPT-2 BPE files, a HF tokenizer, a corpus."""
    if (tmp / "corpus_text_document.idx").exists():
        return
    tf.make_gpt2_bpe(str(tmp / "gpt2"))
    tf.make_hf_dir(str(tmp / "hf"))
    # 2000 documents of ids below both tokenizers' vocabularies: the gpt3 script's --split
    # 949,50,1 leaves 2 of them to the test split (an empty split asked for samples would
    # never fill).
    rng = np.random.default_rng(0)
    write_indexed_dataset(tmp / "corpus_text_document",
                          [rng.integers(3, 128, int(rng.integers(40, 90))).tolist()
                           for _ in range(2000)])


def test_gpt3_script_trains(tmp_path):
    _files(tmp_path)
    argv = script_argv(BY_ID["gpt3-v16-without-rampup"], tmp_path)
    assert "--tokenizer-type" not in argv  # GPT2BPETokenizer: pretrain_gpt.py's default
    metrics = tmp_path / "m.jsonl"
    out = run_pretrain([*argv, *LOCAL, "--metrics-path", str(metrics)])
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


def _profile_on_cpu(tmp: Path) -> List[str]:
    # The script's --profile is an nsys capture range (CUDA); on the CPU the same steps are
    # profiled by torch.profiler (Megatron-LM's --use-pytorch-profiler), its files in tmp.
    return ["--use-pytorch-profiler", "--profile-dir", str(tmp / "profile")]


def test_llama3_script_trains(tmp_path):
    argv = script_argv(BY_ID["llama-v16-bf16"], tmp_path)
    metrics = tmp_path / "m.jsonl"
    out = run_pretrain([*argv, *LOCAL, "--metrics-path", str(metrics), *_profile_on_cpu(tmp_path)])
    records = [r for r in read_metrics(metrics) if "lm_loss" in r]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(np.isfinite(r["lm_loss"]) for r in records)
    # --decoupled-lr: the embedding and output layer's own schedule; the record's lr is the
    # first param group's, one of the two schedules.
    assert records[0]["lr"] > 0
    lines = out.stdout.splitlines()
    # --sequence-parallel with TP 1 is off (as there), in one line; Transformer Engine's
    # fallbacks are a GPU run's news (tests/unit/config/test_config.py), not a CPU run's.
    assert not any("Transformer Engine" in line for line in lines)
    assert not any(line.startswith("--attention-backend fused:") for line in lines)
    assert any(line.startswith("--sequence-parallel: off") for line in lines)
    # NullTokenizer does not read --tiktoken-pattern: ignored as there, in one line.
    assert ("--tiktoken-pattern v2: not read by --tokenizer-type NullTokenizer; ignored, as "
            "Megatron-LM ignores it") in lines
    assert "throughput per GPU (TFLOP/s/GPU, 6N)" in out.stdout  # --log-throughput
    assert "validation loss at iteration 2" in out.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert list((tmp_path / "profile").iterdir())  # --profile 2..3 wrote its files
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))  # --tensorboard-dir


def test_llama3_script_without_save_trains_and_saves_nothing(tmp_path):
    """Megatron-LM's meaning of --save-interval without --save: nothing is saved; here the
    log says so in one line."""
    argv = script_argv(BY_ID["llama-v16-bf16-without-save"], tmp_path)
    assert "--save" not in argv and "--load" not in argv and "--save-interval" in argv
    metrics = tmp_path / "m.jsonl"
    out = run_pretrain([*argv, *LOCAL, "--metrics-path", str(metrics), *_profile_on_cpu(tmp_path)])
    assert [r["iteration"] for r in read_metrics(metrics) if "lm_loss" in r] == [1, 2, 3]
    assert ("--save-interval 2 without --save: no checkpoint will be saved (give --save DIR "
            "to save them)") in out.stdout.splitlines()
    assert "saved checkpoint" not in out.stdout
    assert not list((tmp_path / "ckpt").iterdir())


def test_llama3_v19_script_trains_on_real_data(tmp_path):
    # core_v0.19.0 adds --normalization RMSNorm; the real-data branch gives a Hugging Face
    # tokenizer, --vocab-size (which that tokenizer does not read) and --split '99,1,0'.
    _files(tmp_path)
    argv = script_argv(BY_ID["llama-v19-bf16-real-data"], tmp_path)
    assert argv[argv.index("--normalization") + 1] == "RMSNorm"
    assert argv[argv.index("--split") + 1] == "'99,1,0'"
    metrics = tmp_path / "m.jsonl"
    out = run_pretrain([*argv, *LOCAL, "--metrics-path", str(metrics), *_profile_on_cpu(tmp_path)])
    records = [r for r in read_metrics(metrics) if "lm_loss" in r]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(np.isfinite(r["lm_loss"]) for r in records)
    assert ("--vocab-size 128: not read by --tokenizer-type HuggingFaceTokenizer; ignored, as "
            "Megatron-LM ignores it") in out.stdout.splitlines()
    assert "validation loss at iteration 2" in out.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "3"


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
    (["--context-parallel-size=4"], "--context-parallel-size 4: context parallelism is not "
                                    "supported"),
    (["--ckpt-format", "torch"], "--ckpt-format torch: only torch_dist"),
    (["--ckpt-format", "torch_dcp"], "--ckpt-format torch_dcp: only torch_dist"),
    (["--use-megatron-fsdp"], "--use-megatron-fsdp: Megatron FSDP is not supported"),
    (["--fsdp-double-buffer"], "--fsdp-double-buffer: Megatron FSDP is not supported"),
    (["--step-batch-size-schedule", "0:16", "2.4B:320"],
     "--step-batch-size-schedule: a Megatron-LM core_v0.19.0 flag"),
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


def test_a_supported_value_of_a_refused_value_flag_is_accepted():
    assert value_refusal("--context-parallel-size", "1") is None
    assert value_refusal("--ckpt-format", "torch_dist") is None
    parse_config([*BASE, "--context-parallel-size", "1", "--ckpt-format", "torch_dist"])
