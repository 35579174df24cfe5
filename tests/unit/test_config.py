"""The command line and the config: every flag documented, parsing, cross checks."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from megatron_ext.config import build_parser, parse_config, parse_data_path
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
    cfg = parse_config(["--mock-data", "--vocab-size", "100", "--hidden-size", "96",
                        "--num-attention-heads", "4", "--swiglu", "--seq-length", "64"])
    assert cfg.model.ffn_hidden_size == 256  # 8/3 * 96 = 256, already a multiple of 64
    assert cfg.model.max_position_embeddings == 64
    assert cfg.checkpoint.load_optim is True
    cfg = parse_config(["--mock-data", "--vocab-size", "100", "--no-load-optim"])
    assert cfg.checkpoint.load_optim is False
    assert cfg.model.ffn_hidden_size == 4 * cfg.model.hidden_size


def test_list_flags_parse_their_element_type():
    cfg = parse_config(["--mock-data", "--vocab-size", "100", "--profile", "--profile-ranks",
                        "0", "3"])
    assert cfg.logging.profile_ranks == [0, 3]
    assert parse_config(["--mock-data", "--vocab-size", "100"]).logging.profile_ranks == [0]
    with pytest.raises((UsageError, SystemExit)):
        parse_config(["--mock-data", "--vocab-size", "100", "--profile-ranks", "first"])


@pytest.mark.parametrize("world,args,dp", [
    (1, [], 1), (2, [], 2), (2, ["--tensor-model-parallel-size", "2"], 1),
    (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 2),
])
def test_check_world_gives_dp_and_default_global_batch(world, args, dp):
    cfg = parse_config(["--mock-data", "--vocab-size", "100", "--micro-batch-size", "3", *args])
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

    readme = (ROOT / "README.md").read_text()
    begin, end = "<!-- flags:begin -->\n", "<!-- flags:end -->"
    section = readme[readme.index(begin) + len(begin):readme.index(end)]
    assert section == flags_markdown(), (
        "README flag tables are stale: regenerate with python -m megatron_ext.config.docs")
    for flag in _options(build_parser()):
        if flag not in ("-h", "--help"):
            assert f"`{flag}" in section, flag
