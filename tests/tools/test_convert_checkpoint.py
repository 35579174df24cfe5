"""tools/convert_checkpoint.py: megatron_ext checkpoints <-> Hugging Face transformers.

transformers loads what the tool writes and its logits equal this project's forward
(fp32) for checkpoints saved with TP=2 (Llama-style, GQA, untied) and PP=2 (GPT-2 style,
tied); a model made by transformers converts in, fine-tunes here, and converts back.
"""

from __future__ import annotations

import json

import convert_checkpoint
import model_testlib as lib
import pytest
import torch
from model_testlib import assert_ok, assert_usage_error, call_tool

from megatron_ext.config.model import ModelConfig
from megatron_ext.errors import UsageError
from megatron_ext.model import hf
from mext_testing import TINY, run_pretrain

LAYOUTS = {
    "tp2-llama": (["--tensor-model-parallel-size", "2", *lib.LLAMA], "LlamaForCausalLM"),
    "pp2-gpt2": (["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"],
                 "GPT2LMHeadModel"),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_parallel_checkpoint_to_hf_has_the_same_logits(tmp_path, layout):
    flags, arch = LAYOUTS[layout]
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    run_pretrain([*TINY, *flags, "--train-iters", "2", "--lr-decay-style", "cosine",
                  "--save", str(ckpt)], nproc=2)
    assert_ok(call_tool(convert_checkpoint, "--load", ckpt, "--to", "hf", "--output", out))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [arch] and config["vocab_size"] == 256
    tokens = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(0))
    ours, theirs = lib.project_logits(ckpt, tokens), lib.hf_logits(out, tokens)
    assert ours.shape == theirs.shape == (2, 32, 256)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-4), (ours - theirs).abs().max()


def test_hf_model_converts_in_finetunes_and_converts_back(finetuned_run, tmp_path):
    import generate
    import safetensors.torch
    import transformers

    # In and straight out again: transformers' own weights, bit for bit.
    back = tmp_path / "back"
    assert_ok(call_tool(convert_checkpoint, "--load", finetuned_run.ckpt_in, "--to", "hf",
                        "--output", back))
    original = safetensors.torch.load_file(finetuned_run.hf_in / "model.safetensors")
    returned = safetensors.torch.load_file(back / "model.safetensors")
    assert sorted(original) == sorted(returned)
    for name, tensor in original.items():
        rows = tensor.shape[0]  # the embedding came back padded to the run's 128 rows
        assert torch.equal(returned[name][:rows], tensor), name
    assert not returned["model.embed_tokens.weight"][lib.SP_VOCAB:].any()

    # The fine-tuned model: transformers loads it, same logits, changed weights.
    out = tmp_path / "hf_out"
    assert_ok(call_tool(convert_checkpoint, "--load", finetuned_run.ckpt_out, "--to", "hf",
                        "--output", out))
    tuned = safetensors.torch.load_file(out / "model.safetensors")
    assert not torch.equal(tuned["model.layers.0.self_attn.q_proj.weight"],
                           original["model.layers.0.self_attn.q_proj.weight"])
    tokens = torch.randint(0, lib.SP_VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    ours, theirs = lib.project_logits(finetuned_run.ckpt_out, tokens), lib.hf_logits(out, tokens)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-4), (ours - theirs).abs().max()

    # The tokenizer came along: transformers tokenizes as the run did, and its greedy
    # generation is tools/generate.py's.
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=finetuned_run.tokenizer)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    prompt = "alpha beta gamma"
    assert tokenizer(lib.SENTENCE)["input_ids"] == sp.encode(lib.SENTENCE)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    hf_ids = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    ours_text = call_tool(generate, "--load", finetuned_run.ckpt_out, "--prompt", prompt,
                          "--max-new-tokens", "8", "--greedy", "--device", "cpu").stdout
    assert tokenizer.decode(hf_ids) + "\n" == ours_text


def test_converted_checkpoint_needs_finetune(finetuned_run):
    """A weights-only checkpoint has no optimizer or schedule to resume: plain --load is refused.

    (load_checkpoint refuses before it touches the model: no process of its own needed; the
    files' checksums are the integrity tests' business, so they count as verified here.)
    """
    from types import SimpleNamespace

    from megatron_ext.checkpoint import checkpointing as ckpt

    path = ckpt.checkpoint_name(str(finetuned_run.ckpt_in), 0)
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(finetune=False, load_optim=True),
                          training=SimpleNamespace(skip_train=False))
    with pytest.raises(UsageError, match="holds model weights only .* add --finetune"):
        ckpt.load_checkpoint(path, None, None, None, cfg, None, verified=True)


# Pure tests of the mapping tables (megatron_ext/model/hf.py).

SHAPES = [  # (family, heads, query groups)
    ("llama", 4, 4), ("llama", 4, 2), ("llama", 8, 1), ("gpt2", 4, 4), ("gpt2", 2, 2),
]


def _model_cfg(family, heads, groups, bias=False, untie=True):
    llama = family == "llama"
    return ModelConfig(
        num_layers=2, hidden_size=8 * heads, num_attention_heads=heads, seq_length=32,
        max_position_embeddings=32,
        group_query_attention=groups != heads, num_query_groups=groups, ffn_hidden_size=24,
        normalization="RMSNorm" if llama else "LayerNorm", swiglu=llama,
        position_embedding_type="rope" if llama else "learned_absolute",
        disable_bias_linear=llama and not bias, untie_embeddings_and_output_weights=untie)


def _random_megatron_state(m, family):
    s = hf.shape_of(m)
    qkv = (s.num_query_groups * (s.heads_per_group + 2)) * s.head_dim
    fc1 = m.ffn_hidden_size * (2 if m.swiglu else 1)
    shapes = {"embedding.word_embeddings.weight": (16, m.hidden_size),
              "embedding.position_embeddings.weight": (m.max_position_embeddings, m.hidden_size),
              "decoder.final_layernorm.weight": (m.hidden_size,),
              "decoder.final_layernorm.bias": (m.hidden_size,),
              "output_layer.weight": (16, m.hidden_size)}
    for i in range(m.num_layers):
        p = f"decoder.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (m.hidden_size,),
                       p + "input_layernorm.bias": (m.hidden_size,),
                       p + "self_attention.linear_qkv.weight": (qkv, m.hidden_size),
                       p + "self_attention.linear_qkv.bias": (qkv,),
                       p + "self_attention.linear_proj.weight": (m.hidden_size, m.hidden_size),
                       p + "self_attention.linear_proj.bias": (m.hidden_size,),
                       p + "pre_mlp_layernorm.weight": (m.hidden_size,),
                       p + "pre_mlp_layernorm.bias": (m.hidden_size,),
                       p + "mlp.linear_fc1.weight": (fc1, m.hidden_size),
                       p + "mlp.linear_fc1.bias": (fc1,),
                       p + "mlp.linear_fc2.weight": (m.hidden_size, m.ffn_hidden_size),
                       p + "mlp.linear_fc2.bias": (m.hidden_size,)})
    keep = {name for name, _, _ in hf._rows(family, m.num_layers)}
    if family == "llama":  # RMSNorm has no bias; positions are rotary
        keep = {n for n in keep if not n.endswith("layernorm.bias")}
        keep.discard("embedding.position_embeddings.weight")
        if m.disable_bias_linear:
            keep = {n for n in keep if not n.endswith(".bias")}
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(shapes[n], generator=gen) for n in sorted(keep)}


@pytest.mark.parametrize("family, heads, groups", SHAPES)
def test_mapping_round_trip(family, heads, groups):
    m = _model_cfg(family, heads, groups)
    assert hf.family_of(m) == family
    state = _random_megatron_state(m, family)
    shape = hf.shape_of(m)
    hf_state = hf.megatron_to_hf(state, family, shape)
    back = hf.hf_to_megatron(hf_state, family, shape, list(state))
    assert sorted(back) == sorted(state)
    for name in state:
        assert torch.equal(back[name], state[name]), name


def test_fused_qkv_layout_is_per_query_group():
    """Rows of megatron-core's fused QKV: [group 0: q heads, k, v][group 1: ...]."""
    m = _model_cfg("llama", heads=4, groups=2)
    s = hf.shape_of(m)  # head_dim 8, 2 heads per group
    rows = torch.arange(2 * (2 + 2) * 8, dtype=torch.float32).unsqueeze(1)
    q, k, v = hf._split_qkv(rows, s)
    block = lambda g, j: list(range((g * 4 + j) * 8, (g * 4 + j + 1) * 8))  # noqa: E731
    assert q.squeeze(1).tolist() == block(0, 0) + block(0, 1) + block(1, 0) + block(1, 1)
    assert k.squeeze(1).tolist() == block(0, 2) + block(1, 2)
    assert v.squeeze(1).tolist() == block(0, 3) + block(1, 3)


@pytest.mark.parametrize("changes", [
    {"normalization": "LayerNorm", "swiglu": True},
    {"position_embedding_type": "learned_absolute"},
])
def test_architectures_without_an_hf_counterpart_are_refused(changes):
    fields = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
              **changes}
    with pytest.raises(UsageError, match="no Hugging Face architecture"):
        hf.family_of(ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                                 seq_length=32, max_position_embeddings=32, **fields))


def test_bad_input_is_one_line(tmp_path):
    import transformers

    assert_usage_error(call_tool(convert_checkpoint, "--load", tmp_path, "--to", "onnx",
                                 "--output", tmp_path / "o"), "--to onnx: unknown format")
    assert_usage_error(call_tool(convert_checkpoint, "--load", tmp_path / "missing", "--to", "hf",
                                 "--output", tmp_path / "o"), "--load")
    assert_usage_error(call_tool(convert_checkpoint, "--load", tmp_path, "--to", "hf",
                                 "--output", tmp_path / "o"), "not a checkpoint")
    bert = tmp_path / "bert"
    transformers.BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=16).save_pretrained(str(bert))
    assert_usage_error(call_tool(convert_checkpoint, "--from", "hf", "--input", bert,
                                 "--save", tmp_path / "c"),
                       "unsupported Hugging Face architecture")
    assert_usage_error(call_tool(convert_checkpoint, "--from", "hf", "--input", tmp_path / "none",
                                 "--save", tmp_path / "c"), "--input")


def test_model_settings_from_a_megatron_lm_args_namespace():
    """A checkpoint whose common state has Megatron-LM's ``args`` only (no ``config``)."""
    import argparse

    from megatron_ext.checkpoint import standalone

    args = argparse.Namespace(num_layers=3, hidden_size=32, num_attention_heads=4,
                              ffn_hidden_size=96, seq_length=16, max_position_embeddings=16,
                              normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                              position_embedding_type="rope", group_query_attention=True,
                              num_query_groups=2, untie_embeddings_and_output_weights=True,
                              micro_batch_size=2, lr=1e-3, tensor_model_parallel_size=2)
    m = standalone.model_config({"args": args})
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_query_groups) == (3, 32, 96, 2)
    assert m.disable_bias_linear and m.swiglu and hf.family_of(m) == "llama"
    cfg = standalone.run_config({"args": args})
    assert cfg.parallel.tensor_model_parallel_size == 1  # loaded whole, resharded
    assert cfg.training.micro_batch_size == 2
    with pytest.raises(UsageError, match="records no model settings"):
        standalone.model_config({"checkpoint_version": 1})


def test_checkpoint_of_a_sample_based_run_converts(tmp_path):
    """Its saved training section has --train-samples (and the iterations derived from it):
    the tools rebuild the run's config from it."""
    i = TINY.index("--lr-warmup-iters")
    flags = [*TINY[:i], *TINY[i + 2:], "--train-samples", "24", "--global-batch-size", "8",
             "--rampup-batch-size", "4", "4", "8", "--lr-warmup-samples", "4"]
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    run_pretrain([*flags, "--save", str(ckpt)])
    assert_ok(call_tool(convert_checkpoint, "--load", ckpt, "--to", "hf", "--output", out))
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 256
