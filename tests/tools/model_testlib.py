"""Helpers of the model tools' tests (convert, generate, evaluate).

The tools run in the test process (``run_tool(main, argv)``: what a subprocess would
run, without its ~10 s of imports); training runs are real pretrain_gpt.py processes.
Nothing is downloaded: the HF models are built with transformers' own random init.
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# A sequence with no repeated word: a tiny model memorizes it in a few dozen iterations.
SENTENCE = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
            "omicron pi rho sigma tau upsilon phi chi psi omega. ")
SP_VOCAB = 96

# The shape of the tiny models (pretrain_gpt.py flags).
SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--group-query-attention", "--num-query-groups", "2"]
TRAIN = ["--micro-batch-size", "4", "--lr", "1e-2", "--min-lr", "1e-3", "--lr-warmup-iters", "2",
         "--lr-decay-style", "cosine", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--device", "cpu", "--wandb-mode", "disabled", "--seed", "1234"]


@dataclass
class ToolResult:
    """A tool's exit status and what it wrote."""

    returncode: int
    stdout: str
    stderr: str

    def error_lines(self) -> List[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]


def call_tool(module, *argv) -> ToolResult:
    """Runs a tool's main in this process as its ``__main__`` would."""
    import _common

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = _common.run_tool(module.main, [str(a) for a in argv])
        except SystemExit as exc:  # argparse's own exits (--help, bad flags)
            code = exc.code if isinstance(exc.code, int) else 1
    return ToolResult(code, out.getvalue(), err.getvalue())


def assert_ok(result: ToolResult) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-4000:]}"


def assert_usage_error(result: ToolResult, expected: str) -> None:
    """Exit 2, one ``error:`` line holding ``expected``, no traceback."""
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    errors = result.error_lines()
    assert len(errors) == 1 and expected in errors[0], result.stderr


def project_logits(load: str, tokens):
    """This project's logits ([b, s, vocab], fp32 on the CPU) of the checkpoint ``load``."""
    import torch

    from megatron_ext.checkpoint import standalone
    from megatron_ext.runtime.distributed import shutdown

    try:
        model, _, _, _ = standalone.load_model(str(load), device="cpu")
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        with torch.no_grad():
            return model(tokens, positions, None).float()
    finally:
        shutdown()


def hf_logits(hf_dir, tokens):
    """transformers' logits of the model in ``hf_dir``."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def tiny_hf_llama(directory: Path, vocab_size: int, seed: int = 0) -> None:
    """A tiny LlamaForCausalLM (GQA, untied) with transformers' random init, saved."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=3)
    transformers.LlamaForCausalLM(config).save_pretrained(str(directory))


def repetitive_corpus(directory: Path) -> tuple:
    """A SentencePiece model and a megatron-core dataset of SENTENCE repeated.

    Returns:
        (tokenizer model path, data prefix)
    """
    import sentencepiece

    from mext_testing import write_indexed_dataset

    directory.mkdir(parents=True, exist_ok=True)
    text = directory / "corpus.txt"
    text.write_text((SENTENCE * 4 + "\n") * 8)
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(directory / "tok"), vocab_size=SP_VOCAB,
        model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=3, add_dummy_prefix=False,
        normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2,
        num_threads=1)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(directory / "tok.model"))
    prefix = directory / "rep_text_document"
    write_indexed_dataset(prefix, [sp.encode(SENTENCE * 6) + [sp.eos_id()] for _ in range(120)])
    return str(directory / "tok.model"), str(prefix)


def flags_file(ckpt: Path) -> List[str]:
    """The model flags tools/convert_checkpoint.py --from hf wrote beside the checkpoint."""
    return (ckpt / "model_flags.txt").read_text().split()


def data_flags(tokenizer: str, prefix: str) -> Sequence[str]:
    return ["--data-path", prefix, "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", tokenizer, "--split", "90,10,0"]
