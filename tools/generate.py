#!/usr/bin/env python3
"""Sample a continuation of a prompt from a megatron_ext checkpoint.

::

    python tools/generate.py --load CKPT_DIR --prompt TEXT --max-new-tokens N \\
        [--greedy | --temperature T --top-k K --top-p P] [--seed S] [--device auto|cpu|cuda]

The checkpoint (any saved TP/PP layout) is loaded into one full model in this process;
the tokenizer is the run's (or --tokenizer-type/--tokenizer-model). The continuation
(the new text only) goes to stdout; progress to stderr. Decoding stops after
--max-new-tokens tokens or at the end-of-document token. The model sees at most its
--max-position-embeddings last tokens. Each token re-runs the whole context (no KV
cache): meant for checking a model, not for serving it.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

from _common import (
    ToolArgumentParser,
    ToolError,
    add_tokenizer_args,
    log,
    non_negative_int,
    positive_int,
    run_tool,
    tokenizer_args,
)

from megatron_ext.errors import UsageError  # noqa: E402


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}")
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def build_parser() -> ToolArgumentParser:
    parser = ToolArgumentParser(prog="generate.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, metavar="CKPT_DIR",
                        help="a --save directory (its latest checkpoint) or one iter_NNNNNNN "
                             "folder")
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N",
                        help="tokens to generate at most")
    parser.add_argument("--greedy", action="store_true",
                        help="always take the most likely token (the sampling flags are then "
                             "refused)")
    parser.add_argument("--temperature", type=_positive_float, default=None, metavar="T",
                        help="divide the logits by T before sampling (default 1.0)")
    parser.add_argument("--top-k", type=non_negative_int, default=None, metavar="K",
                        help="sample among the K most likely tokens only (0: all; default 0)")
    parser.add_argument("--top-p", type=_probability, default=None, metavar="P",
                        help="sample among the most likely tokens whose probabilities sum to "
                             "P (nucleus sampling; default 1.0: all)")
    parser.add_argument("--seed", type=int, default=1234, metavar="S",
                        help="seed of the sampling generator")
    parser.add_argument("--no-stop-at-eod", dest="stop_at_eod", action="store_false",
                        help="keep generating past the end-of-document token")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the model runs (auto: cuda when a GPU is visible; the CPU "
                             "runs in fp32, the GPU in the run's precision)")
    add_tokenizer_args(parser)
    return parser


def sampling_settings(args) -> dict:
    """(temperature, top_k, top_p) of the flags; greedy excludes them."""
    given = [f for f, v in (("--temperature", args.temperature), ("--top-k", args.top_k),
                            ("--top-p", args.top_p)) if v is not None]
    if args.greedy and given:
        raise ToolError(f"--greedy takes the most likely token: drop {', '.join(given)}")
    return {"greedy": args.greedy,
            "temperature": 1.0 if args.temperature is None else args.temperature,
            "top_k": args.top_k or 0, "top_p": 1.0 if args.top_p is None else args.top_p}


def trailing_space_note(prompt: str) -> Optional[str]:
    """A note when ``prompt`` ends in a space or tab, else None.

    Subword tokenizers (SentencePiece, GPT-2's BPE) attach a space to the word after it, so
    a prompt ending in one ends on a lone space token that training text almost never has
    there; a small model then continues with something unrelated (a digit, blank lines).
    """
    if prompt[-1:] not in (" ", "\t"):
        return None
    return ("note: the prompt ends in whitespace, which the tokenizer keeps as a token of its "
            "own; the continuation usually reads better when the prompt ends before it")


def next_token(logits, greedy: bool, temperature: float, top_k: int, top_p: float, generator):
    """One token id from the logits of the last position ([vocab], fp32)."""
    import torch

    if greedy:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if top_k and top_k < logits.numel():
        threshold = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always).
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def generate(model, prompt_ids: List[int], max_new_tokens: int, vocab_size: int, window: int,
             device, eod: Optional[int], settings: dict, seed: int) -> List[int]:
    """The new token ids after ``prompt_ids``."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    new: List[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            context = ids[-window:]
            tokens = torch.tensor([context], dtype=torch.long, device=device)
            positions = torch.arange(len(context), device=device).unsqueeze(0)
            logits = model(tokens, positions, None)[0, -1, :vocab_size].float()
            token = next_token(logits, generator=generator, **settings)
            new.append(token)
            ids.append(token)
            if eod is not None and token == eod:
                break
    return new


def prompt_token_ids(tokenizer, prompt: str, vocab: int) -> List[int]:
    """The prompt's token ids, each one the model has.

    Raises:
        ToolError: the tokenizer cannot read it (NullTokenizer's prompt is token ids), it is
            empty, or an id is outside the vocabulary.
    """
    try:
        ids = tokenizer.tokenize(prompt)
    except ValueError as err:
        example = " (e.g. --prompt '1 2 3')" if type(tokenizer).__name__ == "NullTokenizer" \
            else ""
        raise ToolError(f"--prompt {prompt[:60]!r}: {err}{example}") from None
    if not ids:
        raise ToolError("--prompt is empty after tokenization")
    outside = [i for i in ids if not 0 <= i < vocab]
    if outside:
        raise ToolError(f"--prompt: token id {outside[0]} is outside the vocabulary of {vocab} "
                        f"ids (0 to {vocab - 1})")
    return ids


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    settings = sampling_settings(args)
    from megatron_ext.runtime.quiet import quiet_optional_dependencies

    quiet_optional_dependencies()
    try:
        _run(args, settings)
    except UsageError as err:
        raise ToolError(str(err))
    finally:
        from megatron_ext.runtime.distributed import shutdown

        shutdown()


def _run(args, settings: dict) -> None:
    from megatron_ext.checkpoint import standalone
    from megatron_ext.config.data import DataConfig
    from megatron_ext.data.tokenizer import build_tokenizer
    from megatron_ext.runtime.distributed import resolve_device

    path = standalone.resolve_checkpoint(args.load)
    common = standalone.read_common(path)
    tokenizer = build_tokenizer(DataConfig(**standalone.tokenizer_settings(
        common, tokenizer_args(args))))
    on_cpu = resolve_device(args.device).type == "cpu"
    model, cfg, runtime, _ = standalone.load_model(path, device=args.device, fp32=on_cpu)
    vocab = tokenizer.vocab_size
    if vocab > model.vocab_size:
        raise ToolError(f"the tokenizer has {vocab} tokens, the model {model.vocab_size}: "
                        "give the run's --tokenizer-model")
    prompt_ids = prompt_token_ids(tokenizer, args.prompt, vocab)
    log(f"generate: {path} on {runtime.device.type}, prompt of {len(prompt_ids)} tokens, "
        f"{'greedy' if settings['greedy'] else 'sampling'}")
    note = trailing_space_note(args.prompt)
    if note:
        log(note)
    new = generate(model, prompt_ids, args.max_new_tokens, vocab,
                   cfg.model.max_position_embeddings, runtime.device,
                   tokenizer.eod if args.stop_at_eod else None, settings, args.seed)
    text_ids = new[:-1] if new and args.stop_at_eod and new[-1] == tokenizer.eod else new
    sys.stdout.write(tokenizer.detokenize(text_ids) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(run_tool(main))
