"""Megatron-LM flags this project refuses, and why: one table, kept by a test.

A flag of Megatron-LM's ``megatron/training/arguments.py`` (tag core_v0.16.1) is either
accepted by the generated parser with Megatron-LM's name, meaning and default, or it is
in this table and refused in one line that names it and says why. A flag that is in
neither is unknown: argparse's error, shortened to one line with a "did you mean" hint.

The table is data: each helper or lane that implements a flag removes its row (or adds
its own refusals) without touching the code below. The same rows make the refused-flags
tables of docs/flags.md and the README (``python -m megatron_ext.config.docs --write``),
and tests/functional/test_megatron_scripts.py runs Megatron-LM's example scripts against
them.
"""

from __future__ import annotations

import difflib
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

_MOE = ("mixture-of-experts (MoE) is not supported here: megatron-core's MoE layers need "
        "Transformer Engine / grouped-GEMM kernels this project does not wire; train a dense "
        "GPT (drop the MoE flags)")
_FP8 = ("FP8 is not supported here: it needs Transformer Engine's FP8 recipes, which this "
        "project does not wire; train with --bf16")
_FP4 = "FP4 is not supported here: it needs Transformer Engine; train with --bf16"
_FSDP = ("Megatron FSDP is not supported here: its sharded parameters are not what the "
         "offload and ZenFlow engines take; shard the optimizer states with "
         "--use-distributed-optimizer (drop the FSDP flags)")
_CP = ("context parallelism is not supported (it needs Transformer Engine's attention, which "
       "this project does not wire); use 1")

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
    "--use-megatron-fsdp": _FSDP,
    "--data-parallel-sharding-strategy": _FSDP,
    "--outer-dp-sharding-strategy": _FSDP,
    "--init-model-with-meta-device": ("building the model on the meta device is not wired "
                                      "here (it is built on its device); drop the flag"),
    "--use-nccl-ub": ("NCCL user-buffer registration of the data-parallel buffers is not "
                      "wired here; drop the flag"),
    # Megatron-LM core_v0.19.0's gpt3 example gives it; megatron-core 0.16.1 has no such
    # schedule (and Megatron-LM refuses it next to --global-batch-size, as that script has).
    "--step-batch-size-schedule": ("a Megatron-LM core_v0.19.0 flag, not in core_v0.16.1 "
                                   "whose flags this project keeps: ramp the batch with "
                                   "--rampup-batch-size START INCR SAMPLES and --train-samples"),
}

# Flag prefix -> why every flag starting with it is refused.
REFUSED_PREFIXES = {
    "--moe-": _MOE,
    "--fp8-": _FP8,
    "--fp4-": _FP4,
    "--fsdp-": _FSDP,
    "--megatron-fsdp-": _FSDP,
}

# Accepted flag -> (its values that are supported, why any other value is refused). The
# parser knows these flags; only these values of them are refused, in the same one line.
REFUSED_VALUES: Dict[str, Tuple[Tuple[str, ...], str]] = {
    "--context-parallel-size": (("1",), _CP),
    "--ckpt-format": (("torch_dist",), "only torch_dist (megatron-core dist_checkpointing) is "
                                       "supported; use torch_dist"),
}


def value_refusal(flag: str, value) -> Optional[str]:
    """The one-line message refusing ``flag value``, or None when that value is supported.

    Args:
        flag: A flag of :data:`REFUSED_VALUES` (any other flag: None).
        value: Its value as given (a string, or the parsed number).
    """
    if flag not in REFUSED_VALUES:
        return None
    supported, reason = REFUSED_VALUES[flag]
    text = str(value).strip()
    if text in supported or (text.lstrip("+").isdigit() and str(int(text)) in supported):
        return None
    return f"{flag} {text}: {reason}"


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
    """The one-line message for the first refused flag (or flag value) of ``argv``, or None."""
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if not arg.startswith("--"):
            continue
        reason = refusal(arg)
        if reason:
            return f"{arg.split('=', 1)[0]}: {reason}"
        name, eq, value = arg.partition("=")
        if name in REFUSED_VALUES and (eq or i + 1 < len(argv)):
            message = value_refusal(name, value if eq else argv[i + 1])
            if message:
                return message
    return None


def refused_groups() -> List[Tuple[List[str], str]]:
    """The refusals grouped by reason: ``[(flags, why)]``, in the table's order.

    Prefixes appear as ``--moe-*``, refused values as ``--context-parallel-size`` followed
    by ``(other than 1)``.
    """
    groups: Dict[str, List[str]] = {}
    for flag, why in REFUSED.items():
        groups.setdefault(why, []).append(flag)
    for prefix, why in REFUSED_PREFIXES.items():
        groups.setdefault(why, []).append(prefix + "*")
    for flag, (supported, why) in REFUSED_VALUES.items():
        groups.setdefault(why, []).append(f"{flag} (other than {', '.join(supported)})")
    return [(flags, why) for why, flags in groups.items()]


def did_you_mean(flag: str, known: Iterable[str]) -> str:
    """`` (did you mean --X?)`` for the closest known flag, or an empty string."""
    name = flag.split("=", 1)[0]
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


# Flags that Megatron-LM has too, and what differs here ("" = as Megatron-LM: same name,
# meaning and default). A flag of the parser that is in neither table is this project's.
SAME = ""
_UNREAD = ("as Megatron-LM; where the --tokenizer-type does not read it, ignored as there, "
           "with one log line")
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
--data-path --mock-data --eod-mask-loss --num-workers
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
    **{flag: _UNREAD for flag in """
--tokenizer-model --vocab-size --vocab-file --merge-file --tiktoken-pattern --vocab-extra-ids
""".split()},
    "--split": "as megatron-core reads it (the numbers in the text, so '99,1,0' with its "
               "quotes is 99,1,0); characters it would silently drop, such as a minus "
               "sign, are refused",
    "--distributed-backend": "gloo with --device cpu; nccl only on GPUs",
    "--ckpt-format": "torch_dist only (the default there)",
    "--save": "--save-interval is optional: without it, saves at the end of training",
    "--save-interval": "optional with --save (required there); without --save nothing is "
                       "saved, as there, and the log says so",
    "--log-throughput": "TFLOP/s from the 6N estimate, not Megatron-LM's per-layer FLOP count",
    "--tokenizer-type": "not given: GPT2BPETokenizer with --vocab-file / --merge-file "
                        "(pretrain_gpt.py's default there), else NullTokenizer with "
                        "--vocab-size; no BERT, multimodal or SFT types",
    "--profile-dir": "this project's: torch.profiler tables and traces",
}
