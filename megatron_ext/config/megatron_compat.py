"""Megatron-LM flags this project refuses, and why: one table, kept by a test.

A flag of Megatron-LM's ``megatron/training/arguments.py`` (tag core_v0.16.1) is either
accepted by the generated parser with Megatron-LM's name, meaning and default, or it is
in this table and refused in one line that names it and says why. A flag that is in
neither is unknown: argparse's error, shortened to one line with a "did you mean" hint.

The table is data: each helper or lane that implements a flag removes its row (or adds
its own refusals) without touching the code below.
"""

from __future__ import annotations

import difflib
from typing import Iterable, Optional, Sequence

_MOE = ("mixture-of-experts (MoE) is not supported here: megatron-core's MoE layers need "
        "Transformer Engine / grouped-GEMM kernels this project does not wire; train a dense "
        "GPT (drop the MoE flags)")
_FP8 = ("FP8 is not supported here: it needs Transformer Engine's FP8 recipes, which this "
        "project does not wire; train with --bf16")
_FP4 = "FP4 is not supported here: it needs Transformer Engine; train with --bf16"

# Exact flag -> why it is refused.
REFUSED = {
    "--num-experts": _MOE,
    "--expert-model-parallel-size": _MOE,
    "--expert-tensor-parallel-size": _MOE,
    "--fp8-param-gather": _FP8,
    "--no-fp8-wgrad": _FP8,
    "--first-last-layers-bf16": _FP8,
    "--num-layers-at-start-in-bf16": _FP8,
    "--num-layers-at-end-in-bf16": _FP8,
}

# Flag prefix -> why every flag starting with it is refused.
REFUSED_PREFIXES = {
    "--moe-": _MOE,
    "--fp8-": _FP8,
    "--fp4-": _FP4,
}


def refusal(flag: str) -> Optional[str]:
    """Why ``flag`` (``--name`` or ``--name=value``) is refused, or None if it is not."""
    name = flag.split("=", 1)[0]
    if name in REFUSED:
        return REFUSED[name]
    for prefix, reason in REFUSED_PREFIXES.items():
        if name.startswith(prefix):
            return reason
    return None


def first_refused(argv: Sequence[str]) -> Optional[str]:
    """The one-line message for the first refused flag of ``argv``, or None."""
    for arg in argv:
        if arg == "--":
            break
        if arg.startswith("--"):
            reason = refusal(arg)
            if reason:
                return f"{arg.split('=', 1)[0]}: {reason}"
    return None


def did_you_mean(flag: str, known: Iterable[str]) -> str:
    """`` (did you mean --X?)`` for the closest known flag, or an empty string."""
    name = flag.split("=", 1)[0]
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


# Flags that Megatron-LM has too, and what differs here ("" = as Megatron-LM: same name,
# meaning and default). A flag of the parser that is in neither table is this project's.
SAME = ""
MEGATRON_LM = {
    **{flag: SAME for flag in """
--num-layers --hidden-size --num-attention-heads --ffn-hidden-size --seq-length
--max-position-embeddings --kv-channels --norm-epsilon --swiglu --rotary-base --rotary-percent
--apply-layernorm-1p --qk-layernorm
--add-qkv-bias --attention-softmax-in-fp32 --untie-embeddings-and-output-weights
--disable-bias-linear --group-query-attention --num-query-groups --hidden-dropout
--attention-dropout --init-method-std --make-vocab-size-divisible-by --recompute-granularity
--recompute-method --recompute-num-layers --tensor-model-parallel-size
--pipeline-model-parallel-size --use-distributed-optimizer --overlap-grad-reduce
--overlap-param-gather --accumulate-allreduce-grads-in-fp32 --grad-reduce-in-bf16
--sequence-parallel --ddp-bucket-size --distributed-timeout-minutes --micro-batch-size
--global-batch-size --train-iters --exit-interval --exit-duration-in-mins --manual-gc
--manual-gc-interval --no-manual-gc-eval --calculate-per-token-loss --seed --bf16 --fp16
--loss-scale --initial-loss-scale --eval-interval --eval-iters --log-interval --optimizer --lr
--min-lr --lr-decay-style --lr-decay-iters --decoupled-lr --decoupled-min-lr
--train-samples --rampup-batch-size --lr-warmup-samples --lr-decay-samples --lr-warmup-fraction
--lr-warmup-init --lr-wsd-decay-style --lr-wsd-decay-iters --lr-wsd-decay-samples
--weight-decay --adam-beta1 --adam-beta2 --adam-eps --sgd-momentum --clip-grad
--optimizer-cpu-offload --optimizer-offload-fraction --overlap-cpu-optimizer-d2h-h2d
--data-path --split --mock-data --tokenizer-model --vocab-size --eod-mask-loss --num-workers
--no-mmap-bin-files --data-cache-path --load --finetune --no-load-optim --no-load-rng
--dist-ckpt-strictness --wandb-project --wandb-exp-name --wandb-save-dir --log-params-norm
--log-num-zeros-in-grad --timing-log-level --profile --profile-step-start --profile-step-end
--profile-ranks --empty-unused-memory-level --deterministic-mode
""".split()},
    "--normalization": "LayerNorm and RMSNorm (no L2Norm)",
    "--lr-warmup-iters": "a warm-up that reaches the end of the decay is accepted (Megatron-LM "
                         "asserts warm-up < decay): the decay then starts just after it",
    "--position-embedding-type": "learned_absolute and rope only (no mrope, yarn, relative, "
                                 "none)",
    "--transformer-impl": "without Transformer Engine installed: local, with one log line",
    "--attention-backend": "without Transformer Engine: the same attention from SDPA or "
                           "megatron-core's DotProductAttention, with one log line; adds sdpa",
    "--cross-entropy-loss-fusion": "fused on the GPU only; the CPU computes the same loss "
                                   "unfused",
    "--no-gradient-accumulation-fusion": "never fused here: same gradients either way",
    "--no-masked-softmax-fusion": "never fused here: same math either way",
    "--no-rope-fusion": "never fused here: same math either way",
    "--no-persist-layer-norm": "Apex's kernel, never used here: same math either way",
    "--no-create-attention-mask-in-dataloader": "never created here (causal attention by "
                                                "construction): same math either way",
    "--use-mcore-models": "deprecated and ignored there too: always megatron-core's GPTModel",
    "--context-parallel-size": "only 1 (needs Transformer Engine's attention)",
    "--distributed-backend": "gloo with --device cpu; nccl only on GPUs",
    "--ckpt-format": "torch_dist only (the default there)",
    "--save": "--save-interval is optional: without it, saves at the end of training",
    "--save-interval": "optional with --save (required there)",
    "--log-throughput": "TFLOP/s from the 6N estimate, not Megatron-LM's per-layer FLOP count",
    "--tokenizer-type": "SentencePiece and NullTokenizer types only",
    "--profile-dir": "this project's: torch.profiler tables and traces",
}
