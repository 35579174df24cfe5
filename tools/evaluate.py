#!/usr/bin/env python3
"""Validation loss and perplexity of a megatron_ext checkpoint on a data prefix.

::

    python tools/evaluate.py --load CKPT_DIR --data-path PREFIX [--eval-iters N]

Evaluates exactly as the training run does (pretrain_gpt.py's evaluation, through its
own code): the run's sequence length, micro and global batch sizes, --split, seed and
precision, the token-weighted mean of the loss over the first --eval-iters global
batches of the validation split. So on the run's data it reproduces the run's logged
validation loss. The checkpoint (any saved TP/PP layout) is loaded into one full model.
Prints one line ``validation loss ... | perplexity ...`` to stdout, and with
--metrics-path appends a JSON record (``eval/lm_loss``, ``eval/lm_ppl``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
from typing import Optional, Sequence

from _common import (
    HeldStream,
    ToolArgumentParser,
    ToolError,
    add_tokenizer_args,
    log,
    positive_int,
    run_tool,
    tokenizer_args,
)

from megatron_ext.errors import UsageError  # noqa: E402


def build_parser() -> ToolArgumentParser:
    parser = ToolArgumentParser(prog="evaluate.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, metavar="CKPT_DIR",
                        help="a --save directory (its latest checkpoint) or one iter_NNNNNNN "
                             "folder")
    parser.add_argument("--data-path", required=True, nargs="+", metavar="[WEIGHT] PREFIX",
                        help="dataset prefix(es) as pretrain_gpt.py's --data-path")
    parser.add_argument("--split", default=None,
                        help="train,validation,test proportions (default: the run's)")
    parser.add_argument("--eval-iters", type=positive_int, default=None, metavar="N",
                        help="global batches to evaluate (default: the run's --eval-iters)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the model runs (auto: cuda when a GPU is visible)")
    add_tokenizer_args(parser)
    parser.add_argument("--metrics-path", default=None, metavar="FILE",
                        help="append the result as one JSON record to FILE")
    return parser


def evaluate(args) -> dict:
    """Loads the checkpoint and evaluates it; returns the result record."""
    from megatron_ext.checkpoint import checkpointing as ckpt
    from megatron_ext.checkpoint import standalone
    from megatron_ext.training.loop import Trainer

    path = standalone.resolve_checkpoint(args.load)
    common = standalone.read_common(path)
    saved = standalone.saved_sections(common)
    eval_iters = args.eval_iters or saved.get("training", {}).get("eval_iters") or 0
    if eval_iters < 1:
        raise ToolError("the run did not evaluate (--eval-iters 0): give --eval-iters N")
    data = {"mock_data": False, "data_path": list(args.data_path),
            **standalone.tokenizer_settings(common, tokenizer_args(args))}
    if args.split:
        data["split"] = args.split
    cfg = standalone.run_config(common, device=args.device, fp32=False, data=data,
                                training={"skip_train": True, "eval_iters": eval_iters})
    # The trainer's start-up lines go to stderr once the evaluation is under way (not
    # before a bad input's error line): stdout holds the result only.
    with contextlib.redirect_stdout(HeldStream()):
        trainer = Trainer(cfg)
        try:
            trainer.state = ckpt.load_checkpoint(path, trainer.model, trainer.optimizer,
                                                 trainer.scheduler, cfg, trainer.runtime)
            loss = trainer.evaluate()
        finally:
            trainer.close()
    if math.isnan(loss):
        raise ToolError(f"the validation split of --data-path is smaller than --eval-iters "
                        f"{eval_iters} global batches of {cfg.training.global_batch_size}; give "
                        "fewer --eval-iters or more data")
    return {"iteration": trainer.state.iteration, "eval/lm_loss": loss,
            "eval/lm_ppl": math.exp(min(20.0, loss)), "eval_iters": eval_iters,
            "checkpoint": path}


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    from megatron_ext.runtime.quiet import quiet_optional_dependencies

    quiet_optional_dependencies()
    try:
        record = evaluate(args)
    except UsageError as err:
        raise ToolError(str(err))
    finally:
        from megatron_ext.runtime.distributed import shutdown

        shutdown()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"validation loss at iteration {record['iteration']} | lm loss value: "
              f"{record['eval/lm_loss']:.6E} | lm loss PPL: {record['eval/lm_ppl']:.6E} |",
              flush=True)
        if args.metrics_path:
            with open(args.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        log(f"evaluate: {record['eval_iters']} global batches of {record['checkpoint']}")


if __name__ == "__main__":
    raise SystemExit(run_tool(main))
