"""The model's numbers for the memory plan: parameters, state bytes, activations, FLOPs."""

from __future__ import annotations

import pytest

from megatron_ext.config import parse_config
from megatron_ext.memory import shape as shape_mod
from megatron_ext.memory.shape import (
    layer_activation_bytes,
    model_shape,
    state_bytes_per_element,
)
from megatron_ext.model.build import grads_in_fp32
from megatron_ext.training.metrics import num_parameters

COMMON = ["--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "1",
          "--global-batch-size", "64", "--lr", "1e-4", "--train-iters", "10", "--mock-data",
          "--use-distributed-optimizer", "--bf16"]
# The GPTs of bench/gpu/gpu_offload_large.sh (mock data, --vocab-size 32000: padded to 32128),
# whose names are their parameter counts.
GPT = {"12.76B": ["--num-layers", "40", "--hidden-size", "5120", "--num-attention-heads", "40"],
       "16.5B": ["--num-layers", "36", "--hidden-size", "6144", "--num-attention-heads", "48"],
       "20.1B": ["--num-layers", "44", "--hidden-size", "6144", "--num-attention-heads", "48"]}
# Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh (model flags, RMSNorm).
LLAMA3_8B = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
             "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
             "--kv-channels", "128", "--seq-length", "8192", "--max-position-embeddings", "8192",
             "--position-embedding-type", "rope", "--swiglu",
             "--untie-embeddings-and-output-weights",
             "--disable-bias-linear", "--normalization", "RMSNorm", "--micro-batch-size", "1",
             "--global-batch-size", "128", "--lr", "1e-4", "--train-iters", "10", "--mock-data",
             "--use-distributed-optimizer", "--bf16"]


def config(flags, vocab="32000", world=1):
    cfg = parse_config([*flags, "--vocab-size", vocab])
    cfg.check_world(world)
    return cfg


@pytest.mark.parametrize("name", list(GPT))
def test_the_gpt_rows_have_the_parameters_their_names_say(name):
    shape = model_shape(config([*GPT[name], *COMMON]), 32001, 1)
    assert round(shape.total_params / 1e9, 2 if name == "12.76B" else 1) == float(name[:-1])
    assert shape.rank_params == shape.total_params == shape.shard_elements


def test_llama3_8b_has_8_03b_parameters():
    shape = model_shape(config(LLAMA3_8B, vocab="128256"), 128256, 1)
    assert shape.padded_vocab == 128256
    assert round(shape.total_params / 1e9, 2) == 8.03


def test_the_16_5b_counts_as_the_logged_run():
    # bench/results/2026-12-02b-h200: "16520.32M parameters" (the trainer's count).
    assert model_shape(config([*GPT["16.5B"], *COMMON]), 32001, 1).total_params == 16_520_318_976


@pytest.mark.parametrize("extra", [
    [], ["--swiglu"], ["--disable-bias-linear", "--normalization", "RMSNorm"],
    ["--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights"],
    ["--position-embedding-type", "rope", "--qk-layernorm", "--add-qkv-bias",
     "--disable-bias-linear", "--ffn-hidden-size", "100"],
])
def test_whole_model_count_equals_the_trainers(extra):
    flags = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
             "--lr", "1e-3", "--train-iters", "2", "--mock-data", *extra]
    cfg = config(flags, vocab="250")
    shape = model_shape(cfg, 251, 1)
    assert shape.total_params == num_parameters(cfg, shape.padded_vocab)


def test_tensor_and_pipeline_parallel_split_the_rank():
    flags = [*GPT["16.5B"], *COMMON, "--tensor-model-parallel-size", "2",
             "--pipeline-model-parallel-size", "2"]
    cfg = config(flags, world=8)
    shape = model_shape(cfg, 32001, 8)
    h = 6144
    assert shape.dp == 2 and shape.padded_vocab == 32256  # a multiple of 128 x TP
    # The first stage: 18 layers (matrices, QKV and FC1 biases split over TP; the two
    # row-parallel biases and the two LayerNorms replicated), the embedding's half and the
    # position table.
    per_layer = (12 * h * h + 3 * h + 4 * h) // 2 + 2 * h + 2 * 2 * h
    first = 18 * per_layer + 32256 * h // 2 + 2048 * h
    assert shape.rank_params == first
    assert shape.shard_elements == -(-first // 2)


@pytest.mark.parametrize("flags, expected", [
    ([], 12),                                                     # fp32 params: no remainder
    (["--bf16"], 10),                                             # remainder beside bf16
    (["--fp16"], 12),                                             # fp16 params: not exact
    (["--bf16", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
      "--exp-avg-sq-dtype", "bf16"], 6),
    (["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
      "--exp-avg-sq-dtype", "bf16"], 8),
    (["--bf16", "--use-precision-aware-optimizer", "--main-params-dtype", "fp16"], 10),
])
def test_state_bytes_per_element_follows_the_remainder_rule(flags, expected):
    cfg = config(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                  "--seq-length", "32", "--max-position-embeddings", "32",
                  "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "2", "--mock-data",
                  "--use-distributed-optimizer", "--offload-optimizer", *flags], vocab="250")
    assert state_bytes_per_element(cfg) == expected


def test_no_store_param_remainders_gives_full_masters():
    cfg = config(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                  "--seq-length", "32", "--max-position-embeddings", "32",
                  "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "2", "--mock-data",
                  "--use-distributed-optimizer", "--offload-optimizer", "--bf16"], vocab="250")
    cfg.offload.store_param_remainders = False  # --no-store-param-remainders
    assert state_bytes_per_element(cfg) == 12


@pytest.mark.parametrize("flags", [[], ["--bf16"], ["--bf16", "--grad-reduce-in-bf16"],
                                   ["--fp16"], ["--fp16", "--accumulate-allreduce-grads-in-fp32"]])
def test_gradient_dtype_rule_is_the_models(flags):
    cfg = config(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                  "--seq-length", "32", "--max-position-embeddings", "32",
                  "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "2", "--mock-data",
                  *flags], vocab="250")
    assert shape_mod.grads_in_fp32(cfg) == grads_in_fp32(cfg)


def _layer_cfg(*extra, tp=1):
    flags = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
             "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "2",
             "--lr", "1e-3", "--train-iters", "2", "--mock-data", "--bf16",
             "--transformer-impl", "local", "--tensor-model-parallel-size", str(tp), *extra]
    return config(flags, vocab="250", world=tp)


@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (4, False), (4, True)])
def test_layer_activations_are_korthikantis_with_the_score_matrix(tp, sp):
    # The paper's setting: GeLU MLP of 4h, dropout on, the score matrix materialized.
    cfg = _layer_cfg("--attention-backend", "local", *(["--sequence-parallel"] if sp else []),
                     tp=tp)
    s, b, h, a = 512, 2, 1024, 16
    outside = 10 / tp if sp else 10
    expected = s * b * h * (outside + 24 / tp + 5 * a * s / (h * tp))
    assert layer_activation_bytes(cfg, tp) == pytest.approx(expected, rel=1e-9)


def test_flash_attention_and_selective_recompute_drop_the_score_matrix():
    s, b, h, a = 512, 2, 1024, 16
    flash = layer_activation_bytes(_layer_cfg("--attention-backend", "flash"), 1)
    assert flash == s * b * h * 34 + 4 * s * b * a  # the kernel's fp32 statistics only
    selective = layer_activation_bytes(_layer_cfg("--attention-backend", "local",
                                                  "--recompute-granularity", "selective"), 1)
    assert selective == flash


def test_full_recompute_keeps_one_input_per_layer_and_one_layer():
    plain = _layer_cfg("--attention-backend", "flash")
    full = _layer_cfg("--attention-backend", "flash", "--recompute-granularity", "full",
                      "--recompute-method", "uniform", "--recompute-num-layers", "1")
    a_plain = model_shape(plain, 251, 1).activation_bytes
    a_full = model_shape(full, 251, 1).activation_bytes
    layer, hidden = layer_activation_bytes(plain, 1), 2 * 512 * 2 * 1024
    assert a_plain - a_full == 4 * layer - (4 * hidden + layer)


def test_flops_of_the_16_5b_row():
    # Forward+backward of the full-recompute row: 4 passes of every layer, 3 of the output
    # layer; per token and layer 2 x 12h^2 matmul FLOPs and 2 x h x s of causal attention.
    cfg = config([*GPT["16.5B"], *COMMON, "--recompute-granularity", "full",
                  "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    h, s = 6144, 2048
    layer = 2 * 12 * h * h + 2 * h * s
    per_token = 36 * 4 * layer + 3 * 2 * h * 32128
    assert model_shape(cfg, 32001, 1).flops_per_iteration == per_token * 64 * s


@pytest.mark.parametrize("extra", [
    [], ["--bf16"], ["--bf16", "--no-store-param-remainders"], ["--fp16"],
    ["--bf16", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
     "--exp-avg-sq-dtype", "bf16"],
    ["--bf16", "--use-precision-aware-optimizer", "--main-params-dtype", "fp16"],
], ids=["fp32", "bf16", "bf16-whole", "fp16", "bf16-moments", "fp16-master"])
def test_state_bytes_follow_the_engine_layout(extra):
    """The plan's bytes per element are the offload engine's (StateLayout), flag by flag."""
    import torch

    cfg = parse_config(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
                        "4", "--seq-length", "32", "--max-position-embeddings", "32",
                        "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-4",
                        "--train-iters", "2", "--mock-data", "--vocab-size", "128",
                        "--use-distributed-optimizer",
                        "--offload-optimizer", *extra])
    layout = cfg.optimizer.state_layout()
    model_dtype = (torch.bfloat16 if cfg.training.bf16
                   else torch.float16 if cfg.training.fp16 else torch.float32)
    layout = layout.with_remainders(cfg.offload.store_param_remainders
                                    and layout.remainders_apply(model_dtype))
    assert state_bytes_per_element(cfg) == layout.bytes_per_element
