"""The command line and the config: every flag documented, parsing, cross checks."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from megatron_ext.config import build_parser, parse_config
from megatron_ext.data.data_path import parse_data_path
from megatron_ext.errors import UsageError
from megatron_ext.model.build import padded_vocab_size
from mext_testing import PRETRAIN, ROOT, test_env

# The Megatron-LM flags of the CLI contract (../shared/DESIGN.md) and this project's.
CONTRACT = """--num-layers --hidden-size --num-attention-heads --ffn-hidden-size --seq-length
--max-position-embeddings --micro-batch-size --global-batch-size --train-iters --lr --min-lr
--lr-decay-style --lr-warmup-iters --weight-decay --adam-beta1 --adam-beta2 --adam-eps
--clip-grad --bf16 --fp16 --tensor-model-parallel-size --pipeline-model-parallel-size
--use-distributed-optimizer --data-path --split --tokenizer-type --tokenizer-model --save
--load --save-interval --eval-interval --eval-iters --log-interval --seed --finetune
--no-load-optim --exit-interval --wandb-project --wandb-exp-name --wandb-save-dir
--normalization --swiglu --position-embedding-type --untie-embeddings-and-output-weights
--disable-bias-linear --group-query-attention --num-query-groups --transformer-impl
--recompute-granularity --optimizer-cpu-offload --optimizer-offload-fraction --device
--metrics-path --wandb-mode --mock-data""".split()


# What Megatron-LM requires (no defaults there either) and a vocabulary.
REQUIRED = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
            "--lr", "1e-3", "--train-iters", "2"]
MIN = [*REQUIRED, "--mock-data", "--vocab-size", "100"]


def _options(parser):
    return {opt: action for action in parser._actions for opt in action.option_strings}


def test_every_contract_flag_exists():
    options = _options(build_parser())
    missing = [flag for flag in CONTRACT if flag not in options]
    assert not missing


def test_every_flag_has_help():
    for action in build_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and len(action.help) > 10, action.option_strings


def test_help_runs_and_lists_groups():
    out = subprocess.run([sys.executable, PRETRAIN, "--help"], cwd=ROOT, env=test_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for group in ("model:", "parallel:", "training:", "optimizer:", "data:", "checkpoint:",
                  "logging:", "runtime:"):
        assert group in out.stdout
    assert "--no-load-optim" in out.stdout


def test_parse_defaults_and_derived_values():
    cfg = parse_config([*MIN, "--hidden-size", "96", "--num-attention-heads", "4", "--swiglu",
                        "--seq-length", "64", "--max-position-embeddings", "64"])
    assert cfg.model.ffn_hidden_size == 256  # 8/3 * 96 = 256, already a multiple of 64
    assert cfg.model.kv_channels == 24
    assert cfg.checkpoint.load_optim is True
    cfg = parse_config([*MIN, "--no-load-optim"])
    assert cfg.checkpoint.load_optim is False
    assert cfg.model.ffn_hidden_size == 4 * cfg.model.hidden_size


def test_list_flags_parse_their_element_type():
    cfg = parse_config([*MIN, "--profile", "--profile-ranks", "0", "3"])
    assert cfg.logging.profile_ranks == [0, 3]
    assert parse_config(MIN).logging.profile_ranks == [0]
    with pytest.raises(UsageError):
        parse_config([*MIN, "--profile-ranks", "first"])


@pytest.mark.parametrize("world,args,dp", [
    (1, [], 1), (2, [], 2), (2, ["--tensor-model-parallel-size", "2"], 1),
    (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 2),
])
def test_check_world_gives_dp_and_default_global_batch(world, args, dp):
    cfg = parse_config([*MIN, "--micro-batch-size", "3", *args])
    assert cfg.check_world(world) == dp
    assert cfg.training.global_batch_size == 3 * dp


def test_parse_data_path():
    assert parse_data_path(["a", "b"]) == [(1.0, "a"), (1.0, "b")]
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == [(0.3, "a"), (0.7, "b")]
    with pytest.raises(UsageError):
        parse_data_path(["0.3", "a", "b"])


@pytest.mark.parametrize("vocab,div,tp,want", [(129, 128, 1, 256), (128, 128, 1, 128),
                                               (32000, 128, 2, 32000), (32001, 128, 4, 32256)])
def test_padded_vocab_size(vocab, div, tp, want):
    assert padded_vocab_size(vocab, div, tp) == want


def test_readme_flag_tables_match_the_code():
    from megatron_ext.config.docs import flags_markdown

    readme = (ROOT / "docs" / "flags.md").read_text()
    begin, end = "<!-- flags:begin -->\n", "<!-- flags:end -->"
    section = readme[readme.index(begin) + len(begin):readme.index(end)]
    assert section == flags_markdown(), (
        "docs/flags.md is stale: regenerate with python -m megatron_ext.config.docs --write")
    for flag in _options(build_parser()):
        if flag not in ("-h", "--help"):
            assert f"`{flag}" in section, flag


# Megatron-LM's defaults (megatron/training/arguments.py and training_config.py at tag
# core_v0.16.1): one row per default this project follows.
@pytest.mark.parametrize("section,name,want", [
    ("optimizer", "lr_decay_style", "linear"),
    ("training", "log_interval", 100),
    ("training", "eval_iters", 100),
    ("training", "eval_interval", None),  # None: evaluate only at the end of training
    ("data", "num_workers", 2),
    ("model", "recompute_method", None),
    ("model", "recompute_num_layers", None),
    ("model", "transformer_impl", "transformer_engine"),
    ("model", "attention_backend", "auto"),
    ("model", "rotary_percent", 1.0),
    ("parallel", "grad_reduce_in_bf16", False),
    ("parallel", "distributed_backend", "nccl"),
    ("parallel", "context_parallel_size", 1),
    ("checkpoint", "ckpt_format", "torch_dist"),
    ("checkpoint", "dist_ckpt_strictness", "assume_ok_unexpected"),
    ("training", "empty_unused_memory_level", 0),
    ("training", "manual_gc_interval", 0),
    ("training", "manual_gc_eval", True),
    ("data", "mmap_bin_files", True),
    ("optimizer", "weight_decay", 0.01),
    ("optimizer", "adam_beta2", 0.999),
    ("optimizer", "min_lr", 0.0),
])
def test_megatron_lm_default(section, name, want):
    assert getattr(getattr(parse_config(MIN), section), name) == want


@pytest.mark.parametrize("flag", ["--num-layers", "--hidden-size", "--num-attention-heads",
                                  "--seq-length", "--max-position-embeddings",
                                  "--micro-batch-size", "--lr", "--train-iters"])
def test_required_flag_gives_one_line(flag):
    i = REQUIRED.index(flag)
    with pytest.raises(UsageError, match=f"{flag} is required|the training length is required"):
        parse_config([*REQUIRED[:i], *REQUIRED[i + 2:], "--mock-data", "--vocab-size", "100"])


@pytest.mark.parametrize("hidden,want", [(4096, 10880), (96, 256), (64, 128), (5120, 13632)])
def test_swiglu_ffn_rounds_down_as_megatron_lm(hidden, want):
    cfg = parse_config([*MIN, "--hidden-size", str(hidden), "--num-attention-heads", "4",
                        "--swiglu"])
    assert cfg.model.ffn_hidden_size == want == int((4 * hidden * 2 / 3) / 64) * 64


def test_max_position_embeddings_below_seq_length_is_refused():
    with pytest.raises(UsageError, match="must be greater than or equal to --seq-length 32"):
        parse_config([*MIN, "--max-position-embeddings", "16"])


def test_full_recompute_needs_method_and_layers():
    with pytest.raises(UsageError, match="needs --recompute-method"):
        parse_config([*MIN, "--recompute-granularity", "full"])
    cfg = parse_config([*MIN, "--recompute-granularity", "full", "--recompute-method", "uniform",
                        "--recompute-num-layers", "1"])
    assert cfg.model.recompute_method == "uniform"
    with pytest.raises(UsageError, match="selective recompute has no method"):
        parse_config([*MIN, "--recompute-granularity", "selective", "--recompute-method",
                      "block"])


@pytest.mark.parametrize("args,fp32", [
    (["--bf16"], True),  # Megatron-LM: bf16 accumulates and reduces in fp32 by default
    (["--bf16", "--grad-reduce-in-bf16"], False),
    (["--fp16"], False),
    (["--fp16", "--accumulate-allreduce-grads-in-fp32"], True),
    ([], False),  # fp32 training: the gradients are fp32 anyway
])
def test_gradient_precision_follows_megatron_lm(args, fp32):
    from megatron_ext.model.build import grads_in_fp32

    assert grads_in_fp32(parse_config([*MIN, *args])) is fp32


def test_grad_reduce_in_bf16_needs_bf16():
    with pytest.raises(UsageError, match="--grad-reduce-in-bf16 needs --bf16"):
        parse_config([*MIN, "--grad-reduce-in-bf16"])


@pytest.mark.parametrize("impl,backend,te,selective,want", [
    ("transformer_engine", "auto", False, False, ("local", "sdpa")),
    ("transformer_engine", "flash", False, False, ("local", "sdpa")),
    ("transformer_engine", "fused", False, False, ("local", "sdpa")),
    ("transformer_engine", "unfused", False, False, ("local", "local")),
    ("transformer_engine", "local", False, False, ("local", "local")),
    ("transformer_engine", "auto", False, True, ("local", "local")),
    ("local", "sdpa", False, False, ("local", "sdpa")),
    ("transformer_engine", "fused", True, False, ("transformer_engine", "fused")),
    ("transformer_engine", "auto", True, False, ("transformer_engine", "auto")),
])
def test_layer_implementation_and_attention_backend(impl, backend, te, selective, want):
    from megatron_ext.model.build import resolve_layers

    args = [*MIN, "--transformer-impl", impl, "--attention-backend", backend]
    if selective:
        args += ["--recompute-granularity", "selective"]
    got_impl, got_attention, notes = resolve_layers(parse_config(args).model, te)
    assert (got_impl, got_attention) == want
    # Every fallback says so in one log line each; a choice that is taken as given, none.
    assert bool(notes) == ((impl, backend) != want)
    assert all("\n" not in note for note in notes)


@pytest.mark.parametrize("backend", ["local", "sdpa"])
def test_local_attention_with_transformer_engine_is_refused(backend):
    from megatron_ext.model.build import resolve_layers

    cfg = parse_config([*MIN, "--attention-backend", backend])
    with pytest.raises(UsageError, match="--attention-backend"):
        resolve_layers(cfg.model, True)


@pytest.mark.parametrize("args,message", [
    (["--lr-warmup-iterz", "3"], "unrecognized argument --lr-warmup-iterz (did you mean "
                                 "--lr-warmup-iters?)"),
    (["--no-such-flag"], "unrecognized argument --no-such-flag;"),
    (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    (["--lr-decay-style", "wavy"], "argument --lr-decay-style: invalid choice: 'wavy'"),
    (["stray"], "unexpected argument 'stray'"),
])
def test_argparse_errors_are_one_line(args, message):
    with pytest.raises(UsageError) as err:
        parse_config([*MIN, *args])
    assert message in str(err.value)
    assert "\n" not in str(err.value) and "usage:" not in str(err.value)


def test_argparse_error_from_the_command_line_is_one_line():
    out = subprocess.run([sys.executable, PRETRAIN, "--num-layerz", "2"], cwd=ROOT,
                         env=test_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: unrecognized argument --num-layerz (did you mean --num-layers?); see --help "
        "for the flags"]


def test_sequence_parallel_needs_a_sequence_divisible_by_tp():
    cfg = parse_config([*MIN, "--sequence-parallel", "--tensor-model-parallel-size", "2",
                        "--seq-length", "31"])
    with pytest.raises(UsageError, match="--seq-length 31 is not divisible"):
        cfg.check_world(2)
    assert parse_config([*MIN, "--sequence-parallel"]).check_world(1) == 1  # TP 1: off


@pytest.mark.parametrize("flag", ["--moe-router-topk", "--num-experts", "--fp8-format",
                                  "--fp4-format", "--expert-model-parallel-size"])
def test_refusal_table_names_the_flag(flag):
    from megatron_ext.config.megatron_compat import first_refused

    message = first_refused(["--lr", "1", f"{flag}=2"])
    assert message.startswith(f"{flag}: ") and "not supported" in message


def test_compat_table_only_names_flags_of_the_parser():
    from megatron_ext.config.megatron_compat import MEGATRON_LM, refusal

    options = _options(build_parser())
    assert not [flag for flag in MEGATRON_LM if flag not in options]
    assert not [flag for flag in options if refusal(flag)]  # accepted flags are not refused
