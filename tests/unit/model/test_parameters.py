"""The parameter count used for TFLOP/s (6N) equals the model megatron-core builds."""

import pytest
import torch

from megatron_ext.config import parse_config

# The flags Megatron-LM requires (the model shape, micro batch, lr, training length).
REQUIRED = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
            "--lr", "1e-3", "--train-iters", "2"]


@pytest.fixture(scope="module")
def runtime():
    from mext_testing import single_process_runtime

    with single_process_runtime(
            [*REQUIRED, "--mock-data", "--vocab-size", "100", "--device", "cpu"]) as rt:
        yield rt


@pytest.mark.parametrize("args", [
    [],
    ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
     "--untie-embeddings-and-output-weights", "--disable-bias-linear",
     "--group-query-attention", "--num-query-groups", "2"],
    # Head size apart from hidden / heads, a qkv bias without the others, q/k norms,
    # zero-centered norms (this project's Norm in the local spec).
    ["--kv-channels", "8", "--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm",
     "--apply-layernorm-1p", "--swiglu"],
])
def test_num_parameters_matches_model(runtime, args):
    from megatron_ext.model import build_model
    from megatron_ext.model.build import count_parameters
    from megatron_ext.training.metrics import num_parameters

    cfg = parse_config([*REQUIRED, "--mock-data", "--vocab-size", "100", "--device", "cpu",
                        "--hidden-size", "64", "--num-attention-heads", "4", *args])
    cfg.check_world(1)
    model, _ = build_model(cfg, runtime, 128)
    assert num_parameters(cfg, 128) == count_parameters(model)
    assert torch.isfinite(next(model[0].parameters())).all()


def test_decoupled_lr_gives_the_embedding_and_output_their_own_schedule(runtime):
    from megatron_ext.model import build_model
    from megatron_ext.training.optimizer import build_optimizer, build_scheduler

    cfg = parse_config([*REQUIRED, "--mock-data", "--vocab-size", "100", "--device", "cpu",
                        "--untie-embeddings-and-output-weights", "--lr-decay-style", "constant",
                        "--decoupled-lr", "5e-3", "--decoupled-min-lr", "5e-4"])
    cfg.check_world(1)
    model, _ = build_model(cfg, runtime, 128)
    optimizer = build_optimizer(cfg, model, runtime)
    build_scheduler(cfg, optimizer)  # sets each group's lr (step 0)
    gpt = model[0].module
    decoupled = {id(gpt.embedding.word_embeddings.weight), id(gpt.output_layer.weight)}
    lrs = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            lrs[id(param)] = group["lr"]
    assert {lrs[i] for i in decoupled} == {5e-3}
    others = {lr for i, lr in lrs.items() if i not in decoupled}
    assert others == {1e-3}


def test_params_norm_is_the_norm_of_every_parameter_once(runtime):
    from megatron_ext.model import build_model
    from megatron_ext.training.loop import _params_norm

    cfg = parse_config([*REQUIRED, "--mock-data", "--vocab-size", "100", "--device", "cpu"])
    cfg.check_world(1)
    model, _ = build_model(cfg, runtime, 128)
    want = torch.sqrt(sum(p.detach().float().pow(2).sum() for p in model[0].parameters()))
    assert _params_norm(model) == pytest.approx(float(want), rel=1e-6)
