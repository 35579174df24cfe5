#!/usr/bin/env bash
# The configuration of the Slurm job scripts (pretrain_gpt.sbatch and
# pretrain_gpt_multinode.sbatch), without Slurm: torchrun on this machine. Run it before
# submitting, to see the job start, train, log and save in a minute:
#
#   bash examples/slurm/smoke_local.sh                       # GPUs when visible, else CPU
#   NUM_LAYERS=24 HIDDEN_SIZE=2048 NUM_ATTENTION_HEADS=16 PRECISION=bf16 \
#     bash examples/slurm/smoke_local.sh                     # the job's model, 20 iterations
#
# It takes the same knobs (environment variables) as the job scripts, with the same
# defaults and flag groups, except for what a smoke run changes: TRAIN_ITERS (20),
# LR_WARMUP_ITERS (2), LOG_INTERVAL (1), SAVE_INTERVAL and EVAL_INTERVAL (10), EVAL_ITERS (2),
# RUN_DIR (runs/smoke_local), NPROC (the GPUs nvidia-smi lists, else 2) and DEVICE (cuda
# when there are GPUs, else cpu). On a machine without GPUs the model defaults to the tiny
# one of the tests (2 layers, hidden 64, 4 heads, sequence 32, micro-batch 4, vocabulary
# 250, lr 1e-2), which trains in seconds. Like the jobs it resumes from the latest
# checkpoint in SAVE_DIR: delete RUN_DIR to start over. The knobs:
#
#   model     NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS SEQ_LENGTH MAX_POSITION_EMBEDDINGS
#   training  TRAIN_ITERS MICRO_BATCH_SIZE GLOBAL_BATCH_SIZE LR MIN_LR LR_DECAY_STYLE LR_WARMUP_ITERS
#             WEIGHT_DECAY SEED PRECISION (bf16 | fp16 | fp32)
#   data      DATA_PATH (empty: mock data) TOKENIZER_TYPE TOKENIZER_MODEL SPLIT VOCAB_SIZE
#   output    RUN_DIR SAVE_DIR SAVE_INTERVAL LOG_INTERVAL EVAL_INTERVAL EVAL_ITERS
#             METRICS_PATH WANDB_PROJECT WANDB_MODE
#   parallel  TP PP
#   runtime   NPROC DEVICE PYTHON EXTRA_ARGS
set -euo pipefail

log() { echo "[$(date '+%F %T')] smoke_local.sh: $*"; }
die() { log "error: $*" >&2; exit 2; }

REPO=${MEGATRON_EXT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
cd "$REPO"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi

# ---- knobs (environment): the job scripts' defaults, shortened to a smoke run ----
GPUS=0
if command -v nvidia-smi >/dev/null 2>&1; then GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
if (( GPUS > 0 )); then
  DEVICE=${DEVICE:-cuda}
  NPROC=${NPROC:-$GPUS}
else
  DEVICE=${DEVICE:-cpu}
  NPROC=${NPROC:-2}
fi
if [ "$DEVICE" = cpu ]; then
  : "${NUM_LAYERS:=2}" "${HIDDEN_SIZE:=64}" "${NUM_ATTENTION_HEADS:=4}" "${SEQ_LENGTH:=32}"
  : "${MICRO_BATCH_SIZE:=4}" "${VOCAB_SIZE:=250}" "${LR:=1e-2}" "${MIN_LR:=1e-4}"
fi
TRAIN_ITERS=${TRAIN_ITERS:-20}
: "${LR_WARMUP_ITERS:=2}" "${LOG_INTERVAL:=1}" "${SAVE_INTERVAL:=10}" "${EVAL_INTERVAL:=10}"
: "${EVAL_ITERS:=2}"
if [ "$DEVICE" = cpu ]; then PRECISION=${PRECISION:-fp32}; else PRECISION=${PRECISION:-bf16}; fi
RUN_DIR=${RUN_DIR:-$REPO/runs/smoke_local}
SAVE_DIR=${SAVE_DIR:-$RUN_DIR/checkpoints}
METRICS_PATH=${METRICS_PATH:-$RUN_DIR/metrics.jsonl}
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"

MODEL_ARGS=(
  --num-layers "${NUM_LAYERS:-12}"
  --hidden-size "${HIDDEN_SIZE:-768}"
  --num-attention-heads "${NUM_ATTENTION_HEADS:-12}"
  --seq-length "${SEQ_LENGTH:-1024}"
  --max-position-embeddings "${MAX_POSITION_EMBEDDINGS:-${SEQ_LENGTH:-1024}}"
)
TRAIN_ARGS=(
  --train-iters "$TRAIN_ITERS"
  --micro-batch-size "${MICRO_BATCH_SIZE:-4}"
  --lr "${LR:-6e-4}"
  --min-lr "${MIN_LR:-6e-5}"
  --lr-decay-style "${LR_DECAY_STYLE:-cosine}"
  --lr-warmup-iters "${LR_WARMUP_ITERS:-200}"
  --weight-decay "${WEIGHT_DECAY:-0.1}"
  --seed "${SEED:-1234}"
)
[ -z "${GLOBAL_BATCH_SIZE:-}" ] || TRAIN_ARGS+=(--global-batch-size "$GLOBAL_BATCH_SIZE")
case $PRECISION in
  bf16) TRAIN_ARGS+=(--bf16) ;;
  fp16) TRAIN_ARGS+=(--fp16) ;;
  fp32) ;;
  *) die "PRECISION must be bf16, fp16 or fp32, not '$PRECISION'" ;;
esac
if [ -n "${DATA_PATH:-}" ]; then
  read -r -a DATA_PREFIXES <<< "$DATA_PATH"
  DATA_ARGS=(--data-path "${DATA_PREFIXES[@]}" --split "${SPLIT:-969,30,1}")
  TOKENIZER_TYPE=${TOKENIZER_TYPE:-GPTSentencePieceTokenizer}
  if [ "$TOKENIZER_TYPE" = NullTokenizer ]; then
    DATA_ARGS+=(--tokenizer-type NullTokenizer --vocab-size "${VOCAB_SIZE:-32000}")
  else
    [ -n "${TOKENIZER_MODEL:-}" ] || die "DATA_PATH needs TOKENIZER_MODEL (or TOKENIZER_TYPE=NullTokenizer)"
    DATA_ARGS+=(--tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL")
  fi
else
  DATA_ARGS=(--mock-data --vocab-size "${VOCAB_SIZE:-32000}")
fi
OUTPUT_ARGS=(
  --save "$SAVE_DIR"
  --load "$SAVE_DIR"
  --save-interval "${SAVE_INTERVAL:-1000}"
  --log-interval "${LOG_INTERVAL:-10}"
  --eval-interval "${EVAL_INTERVAL:-1000}"
  --eval-iters "${EVAL_ITERS:-10}"
  --metrics-path "$METRICS_PATH"
)
if [ -n "${WANDB_PROJECT:-}" ]; then
  OUTPUT_ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "smoke_local"
                --wandb-save-dir "$RUN_DIR" --wandb-mode "${WANDB_MODE:-offline}")
fi
PARALLEL_ARGS=(
  --tensor-model-parallel-size "${TP:-1}"
  --pipeline-model-parallel-size "${PP:-1}"
  --use-distributed-optimizer
  --device "$DEVICE"
)
LAUNCHER=(
  "$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node="$NPROC"
)

mkdir -p "$RUN_DIR" "$SAVE_DIR"
log "$NPROC processes, $DEVICE, checkpoints in $SAVE_DIR"
CMD=("${LAUNCHER[@]}" pretrain_gpt.py "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}"
     "${OUTPUT_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${EXTRA[@]}")
log "${CMD[*]}"
exec "${CMD[@]}"
