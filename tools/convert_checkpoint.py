#!/usr/bin/env python3
"""Convert a megatron_ext checkpoint to Hugging Face transformers format, and back.

To HF::

    python tools/convert_checkpoint.py --load CKPT_DIR --to hf --output HF_DIR

reads the checkpoint of any saved TP/PP layout (megatron-core's dist_checkpointing
reshards it into one full model in this process, on the CPU) and writes HF_DIR with
``config.json``, ``model.safetensors`` and, when the run used a SentencePiece model,
``tokenizer.model`` with a LlamaTokenizer ``tokenizer_config.json`` (transformers loads
it offline). RMSNorm+SwiGLU+RoPE models become ``LlamaForCausalLM``; LayerNorm+GeLU+
learned positions with biases become ``GPT2LMHeadModel``. The architecture comes from the
checkpoint's saved settings. The embedding keeps the run's padded vocabulary rows.

From HF::

    python tools/convert_checkpoint.py --from hf --input HF_DIR --save CKPT_DIR

writes a weights-only checkpoint (iteration 0) that pretrain_gpt.py fine-tunes from with
``--load CKPT_DIR --finetune`` and the model flags this tool prints (the model shape,
--normalization, --swiglu, --position-embedding-type, --disable-bias-linear,
--untie-embeddings-and-output-weights, --group-query-attention/--num-query-groups,
--norm-epsilon, --rotary-base, --max-position-embeddings, --hidden-dropout,
--attention-dropout; also in CKPT_DIR/model_flags.txt) and a tokenizer whose padded
vocabulary equals the checkpoint's (the HF vocabulary padded up to a multiple of
--make-vocab-size-divisible-by).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Dict, List, Optional, Sequence

from _common import ToolArgumentParser, ToolError, log, run_tool

from megatron_ext.errors import UsageError  # noqa: E402


def build_parser() -> ToolArgumentParser:
    parser = ToolArgumentParser(
        prog="convert_checkpoint.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="pretrain_gpt.py fine-tunes a converted checkpoint with --load CKPT_DIR "
               "--finetune and the model flags printed at the end of the conversion (also in "
               "CKPT_DIR/model_flags.txt).",
    )
    parser.add_argument("--load", metavar="CKPT_DIR",
                        help="--to hf: a --save directory (its latest checkpoint) or one "
                             "iter_NNNNNNN folder")
    parser.add_argument("--to", metavar="FORMAT",
                        help="convert --load to this format: hf")
    parser.add_argument("--output", metavar="HF_DIR", help="--to hf: the directory to write")
    parser.add_argument("--from", dest="from_format", metavar="FORMAT",
                        help="convert --input from this format: hf")
    parser.add_argument("--input", metavar="HF_DIR",
                        help="--from hf: a transformers model directory (config.json and "
                             "*.safetensors or pytorch_model.bin)")
    parser.add_argument("--save", metavar="CKPT_DIR",
                        help="--from hf: the checkpoint directory to write")
    parser.add_argument("--tokenizer-model", metavar="FILE",
                        help="--to hf: the SentencePiece .model to include (default: the one the "
                             "run trained with, when it still exists); --from hf: a "
                             "tokenizer.model in HF_DIR is copied beside the checkpoint")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128, metavar="N",
                        help="--from hf: pad the embedding rows up to a multiple of N (as "
                             "pretrain_gpt.py pads the tokenizer's vocabulary)")
    return parser


def _check_output(flag: str, path: str) -> None:
    """The directory to write can be made there (a file in the way is found now, not after
    the conversion)."""
    from megatron_ext.config.checks import output_path

    try:
        output_path(flag, path)
    except UsageError as err:
        raise ToolError(str(err)) from None


def _check_args(args) -> str:
    if args.to is not None and args.from_format is not None:
        raise ToolError("--to and --from are exclusive; give one direction")
    if args.to is not None:
        if args.to != "hf":
            raise ToolError(f"--to {args.to}: unknown format; supported: hf")
        if not args.load or not args.output:
            raise ToolError("--to hf needs --load CKPT_DIR and --output HF_DIR")
        _check_output("--output", args.output)
        return "to_hf"
    if args.from_format is not None:
        if args.from_format != "hf":
            raise ToolError(f"--from {args.from_format}: unknown format; supported: hf")
        if not args.input or not args.save:
            raise ToolError("--from hf needs --input HF_DIR and --save CKPT_DIR")
        if args.make_vocab_size_divisible_by < 1:
            raise ToolError("--make-vocab-size-divisible-by must be >= 1")
        _check_output("--save", args.save)
        return "from_hf"
    raise ToolError("give --to hf (with --load, --output) or --from hf (with --input, --save)")


# ---- to HF ------------------------------------------------------------------------------


def _tokenizer_files(out_dir: str, model_path: str, hf_config: Dict) -> None:
    """Copies the SentencePiece model and writes a LlamaTokenizer config for it."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
    shutil.copyfile(model_path, os.path.join(out_dir, "tokenizer.model"))

    def piece(i):
        return sp.id_to_piece(i) if 0 <= i < sp.get_piece_size() else None

    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_path, "rb") as f:
        proto.ParseFromString(f.read())
    config = {
        "tokenizer_class": "LlamaTokenizer",
        # LlamaTokenizer prepends a space unless told otherwise; tools/train_tokenizer.py's
        # models add no dummy prefix, and the ids must equal the SentencePiece model's.
        "add_prefix_space": bool(proto.normalizer_spec.add_dummy_prefix),
        "bos_token": piece(sp.bos_id()), "eos_token": piece(sp.eos_id()),
        "unk_token": piece(sp.unk_id()), "pad_token": piece(sp.pad_id()),
        # megatron_ext tokenizes without BOS/EOS; the end of document is EOS.
        "add_bos_token": False, "add_eos_token": False,
        "model_max_length": hf_config.get("max_position_embeddings")
        or hf_config.get("n_positions"),
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({k: v for k, v in config.items() if v is not None}, f, indent=2)
    hf_config.update(bos_token_id=sp.bos_id() if sp.bos_id() >= 0 else None,
                     eos_token_id=sp.eos_id(),
                     pad_token_id=sp.pad_id() if sp.pad_id() >= 0 else None)


def to_hf(args) -> None:
    import safetensors.torch

    from megatron_ext.checkpoint import standalone
    from megatron_ext.model import hf

    path = standalone.resolve_checkpoint(args.load)
    common = standalone.read_common(path)
    model_cfg = standalone.model_config(common)
    family = hf.family_of(model_cfg)
    if os.path.isdir(args.output) and os.listdir(args.output):
        raise ToolError(f"--output {args.output} exists and is not empty; give a new directory")
    model, cfg, _, _ = standalone.load_model(path, device="cpu", fp32=True)
    state = {k: v for k, v in model.state_dict().items() if v is not None}
    vocab = model.embedding.word_embeddings.weight.shape[0] if model.pre_process else None
    hf_state = hf.megatron_to_hf(state, family, hf.shape_of(model_cfg))
    if not model_cfg.untie_embeddings_and_output_weights:
        hf_state.pop("lm_head.weight", None)
    fields = hf.hf_config_fields(model_cfg, family, vocab)
    # Token ids of the run's tokenizer: NullTokenizer's end of document is --vocab-size;
    # a SentencePiece model's ids are filled in below.
    data = standalone.saved_sections(common).get("data", {})
    eod = data.get("vocab_size") if data.get("tokenizer_type") == "NullTokenizer" else None
    fields.update(bos_token_id=None, eos_token_id=eod, pad_token_id=None)
    tokenizer_model = args.tokenizer_model or cfg_tokenizer(common)
    if args.tokenizer_model and not os.path.isfile(args.tokenizer_model):
        raise ToolError(f"--tokenizer-model {args.tokenizer_model}: file not found")
    tmp = args.output.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    if tokenizer_model:
        _tokenizer_files(tmp, tokenizer_model, fields)
    config = _hf_config_class(family)(**fields)
    config.save_pretrained(tmp)
    safetensors.torch.save_file({k: v.contiguous() for k, v in hf_state.items()},
                                os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    if os.path.isdir(args.output):
        os.rmdir(args.output)
    os.replace(tmp, args.output)
    log(f"wrote {hf.HF_CLASS[family]} ({len(hf_state)} tensors, vocab {vocab}"
        f"{', tokenizer.model' if tokenizer_model else ', no tokenizer'}) to {args.output}")


def cfg_tokenizer(common: dict) -> Optional[str]:
    """The run's SentencePiece model file, when the run used one and it still exists."""
    from megatron_ext.checkpoint import standalone

    data = standalone.saved_sections(common).get("data", {})
    path = data.get("tokenizer_model")
    if data.get("tokenizer_type") in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer") \
            and path:
        if os.path.isfile(path):
            return path
        log(f"warning: the run's tokenizer {path} no longer exists; no tokenizer written "
            "(give --tokenizer-model FILE)")
    return None


def _hf_config_class(family: str):
    import transformers

    return {"llama": transformers.LlamaConfig, "gpt2": transformers.GPT2Config}[family]


# ---- from HF ----------------------------------------------------------------------------


def _read_hf_state(directory: str) -> Dict:
    import safetensors.torch
    import torch

    names = sorted(os.listdir(directory))
    shards = [n for n in names if n.endswith(".safetensors")]
    state = {}
    if shards:
        for name in shards:
            state.update(safetensors.torch.load_file(os.path.join(directory, name)))
        return state
    bins = [n for n in names if n.startswith("pytorch_model") and n.endswith(".bin")]
    if not bins:
        raise ToolError(f"--input {directory}: no *.safetensors or pytorch_model*.bin weights")
    for name in bins:
        state.update(torch.load(os.path.join(directory, name), map_location="cpu",
                                weights_only=True))
    return state


def _hf_config(directory: str):
    import transformers

    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ToolError(f"--input {directory}: no config.json (not a transformers model "
                        "directory)")
    try:
        return transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except (ValueError, KeyError, OSError) as err:
        raise ToolError(f"--input {directory}: unsupported config.json "
                        f"({str(err).splitlines()[0][:200]})")


def model_flags(m) -> List[str]:
    """The pretrain_gpt.py model flags of a ModelConfig."""
    flags = ["--num-layers", m.num_layers, "--hidden-size", m.hidden_size,
             "--num-attention-heads", m.num_attention_heads, "--ffn-hidden-size",
             m.ffn_hidden_size, "--max-position-embeddings", m.max_position_embeddings,
             "--normalization", m.normalization, "--norm-epsilon", m.norm_epsilon,
             "--position-embedding-type", m.position_embedding_type,
             "--hidden-dropout", m.hidden_dropout, "--attention-dropout", m.attention_dropout]
    if m.position_embedding_type == "rope":
        flags += ["--rotary-base", m.rotary_base]
    if m.swiglu:
        flags.append("--swiglu")
    if m.disable_bias_linear:
        flags.append("--disable-bias-linear")
    if m.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    if m.group_query_attention:
        flags += ["--group-query-attention", "--num-query-groups", m.num_query_groups]
    return [str(f) for f in flags]


def from_hf(args) -> None:
    import torch

    from megatron_ext.checkpoint import standalone
    from megatron_ext.config.model import ModelConfig
    from megatron_ext.model import hf

    if not os.path.isdir(args.input):
        raise ToolError(f"--input {args.input}: no such directory")
    hf_config = _hf_config(args.input)
    family, fields = hf.model_fields_from_hf(hf_config)
    note = hf.gelu_note(hf_config)
    if note:
        log(f"warning: {note}")
    fields["make_vocab_size_divisible_by"] = args.make_vocab_size_divisible_by
    model_cfg = ModelConfig(**fields)
    hf_state = _read_hf_state(args.input)
    embed_name = hf.FAMILIES[family][0][1][0]
    if embed_name not in hf_state:
        raise ToolError(f"--input {args.input}: no {embed_name} in the weights")
    vocab = hf_state[embed_name].shape[0]
    padded = -(-vocab // args.make_vocab_size_divisible_by) * args.make_vocab_size_divisible_by
    common = {"config": {"model": {**fields}}}
    cfg = standalone.run_config(common, device="cpu", fp32=True)
    cfg.check_world(1)
    runtime = standalone.initialize_single(cfg)
    model = standalone.build_bare_model(cfg, runtime, padded)
    expected = [k for k in model.state_dict() if not hf._ignorable(k)]
    state = hf.hf_to_megatron(hf_state, family, hf.shape_of(model_cfg), expected)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in state and state[name].shape[0] < padded:
            # Rows past the HF vocabulary are the padding pretrain_gpt.py adds.
            pad = torch.zeros(padded - state[name].shape[0], state[name].shape[1],
                              dtype=state[name].dtype)
            state[name] = torch.cat([state[name], pad])
    current = model.state_dict()
    for name, tensor in state.items():
        if tuple(current[name].shape) != tuple(tensor.shape):
            raise ToolError(f"--input {args.input}: {name} has shape {tuple(tensor.shape)}, "
                            f"the model from its config.json needs {tuple(current[name].shape)}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not hf._ignorable(k)]
    if missing or unexpected:
        raise ToolError(f"--input {args.input}: weights do not fit ({missing[:3]} missing, "
                        f"{unexpected[:3]} unexpected)")
    model.config.params_dtype = torch.float32
    path = standalone.save_weights_checkpoint(model, cfg, args.save)
    flags = " ".join(model_flags(model_cfg))
    with open(os.path.join(args.save, "model_flags.txt"), "w") as f:
        f.write(flags + "\n")
    tok = args.tokenizer_model or os.path.join(args.input, "tokenizer.model")
    if os.path.isfile(tok):
        shutil.copyfile(tok, os.path.join(args.save, "tokenizer.model"))
    log(f"wrote {path} from {hf.HF_CLASS[family]} (vocab {vocab} padded to {padded})")
    log(f"fine-tune it with: pretrain_gpt.py --load {args.save} --finetune {flags} ...")


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    direction = _check_args(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from megatron_ext.runtime.quiet import quiet_optional_dependencies

    quiet_optional_dependencies()
    try:
        (to_hf if direction == "to_hf" else from_hf)(args)
    except UsageError as err:
        raise ToolError(str(err))
    finally:
        from megatron_ext.runtime.distributed import shutdown

        shutdown()


if __name__ == "__main__":
    raise SystemExit(run_tool(main))
