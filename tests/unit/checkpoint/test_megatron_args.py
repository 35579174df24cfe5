"""Megatron-LM's ``args`` of this project's checkpoints: names, values, safe loading."""

from __future__ import annotations

import io

import pytest
import torch

from megatron_ext.checkpoint.checkpoint_args import differences, saved_settings
from megatron_ext.checkpoint.checkpointing import sharded_metadata
from megatron_ext.checkpoint.megatron_args import layout_of, megatron_args, train_state_of
from megatron_ext.config import parse_config

FLAGS = ["--num-layers", "3", "--hidden-size", "96", "--num-attention-heads", "6",
         "--seq-length", "64", "--max-position-embeddings", "128", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "1e-3", "--train-samples", "800", "--mock-data",
         "--vocab-size", "1000", "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--disable-bias-linear",
         "--group-query-attention", "--num-query-groups", "2", "--bf16",
         "--use-distributed-optimizer", "--untie-embeddings-and-output-weights"]


def _args():
    cfg = parse_config(FLAGS)
    cfg.check_world(4)
    return cfg, megatron_args(cfg, {"world_size": 4, "tp": 2, "pp": 1, "dp": 2},
                              {"iteration": 7, "consumed_train_samples": 56,
                               "skipped_train_samples": 0}, 1024, None)


# What Megatron-LM's load_checkpoint, check_checkpoint_args, load_args_from_checkpoint and
# tools/checkpoint/loader_base.py read from a checkpoint's args, with this run's values.
@pytest.mark.parametrize("name,want", [
    ("num_layers", 3), ("hidden_size", 96), ("num_attention_heads", 6), ("ffn_hidden_size", 256),
    ("kv_channels", 16), ("group_query_attention", True), ("num_query_groups", 2),
    ("seq_length", 64), ("max_position_embeddings", 128), ("padded_vocab_size", 1024),
    ("tensor_model_parallel_size", 2), ("pipeline_model_parallel_size", 1),
    ("world_size", 4), ("data_parallel_size", 2), ("virtual_pipeline_model_parallel_size", None),
    ("normalization", "RMSNorm"), ("swiglu", True), ("position_embedding_type", "rope"),
    ("add_bias_linear", False), ("add_qkv_bias", False), ("add_position_embedding", True),
    ("untie_embeddings_and_output_weights", True), ("bf16", True), ("fp16", False),
    ("params_dtype", torch.bfloat16), ("consumed_train_samples", 56),
    ("consumed_valid_samples", 0), ("train_iters", 100), ("train_samples", 800),
    ("global_batch_size", 8), ("micro_batch_size", 2), ("use_dist_ckpt", True),
    ("ckpt_format", "torch_dist"), ("tokenizer_type", None), ("vocab_size", 1000),
    ("make_vocab_size_divisible_by", 128), ("lr", 1e-3), ("lr_decay_style", "linear"),
    ("use_distributed_optimizer", True), ("iteration", 7), ("no_save_rng", None),
    # Megatron-LM 0.16's own names for --norm-epsilon and --apply-layernorm-1p, and the
    # fused kernels (Apex's, Transformer Engine's) this project never runs.
    ("layernorm_epsilon", 1e-5), ("layernorm_zero_centered_gamma", False),
    ("apply_rope_fusion", False), ("gradient_accumulation_fusion", False),
    ("masked_softmax_fusion", False), ("persist_layer_norm", False),
])
def test_args_carry_megatron_lms_names_and_values(name, want):
    _, args = _args()
    assert getattr(args, name) == want


def test_args_give_back_the_model_settings():
    cfg, args = _args()
    saved = saved_settings({"args": args})
    assert differences(saved, cfg.model, 1024, shape_only=False) == []


def test_args_load_with_weights_only():
    import megatron.core  # noqa: F401 - registers argparse.Namespace as a safe global

    _, args = _args()
    buf = io.BytesIO()
    torch.save({"args": args}, buf)
    buf.seek(0)
    assert vars(torch.load(buf, weights_only=True)["args"]) == vars(args)


def test_progress_of_a_megatron_lm_checkpoint():
    _, args = _args()
    common = {"args": args, "iteration": 7, "num_floating_point_operations_so_far": 5.0}
    assert train_state_of(common) == {
        "iteration": 7, "consumed_train_samples": 56, "optimizer_steps": 7,
        "skipped_iterations": 0, "num_floating_point_operations_so_far": 5.0}
    assert layout_of(common) == (2, 1)
    assert layout_of({}) is None


@pytest.mark.parametrize("distributed,want", [
    (True, {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True}),
    (False, {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}),
])
def test_content_metadata_is_megatron_lms(distributed, want):
    flags = [f for f in FLAGS if f != "--use-distributed-optimizer" or distributed]
    assert sharded_metadata(parse_config(flags)) == want
