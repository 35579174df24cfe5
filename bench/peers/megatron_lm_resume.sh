#!/usr/bin/env bash
# Checkpoints between this project and Megatron-LM (one device, same layout).
#
#   1. this project trains a tiny-ish GPT for N iterations and --save's;
#   2. Megatron-LM's own pretrain_gpt.py (from MLM_DIR, through bench/peers/megatron_lm_launch.py:
#      two resume fixes for megatron-core without Apex/Transformer Engine, see there)
#      --load's that checkpoint and trains M more iterations;
#   3. the reverse: Megatron-LM trains N and saves, this project --load's and trains M more;
#   plus each side's uninterrupted N+M iterations as the reference.
# Prints the loss curves and the iteration each side resumed at, then compares the saved
# checkpoints tensor by tensor (the straight runs' at N and N+M, and each resumed run's at N+M
# against the straight run of the side it resumed from: bitwise equal where both compute the
# same thing); logs go to $OUT (this_project_*.log, megatron_lm_*.log, summary.txt).
#
# Usage (repository root; Megatron-LM's source in MLM_DIR: tag core_v0.16.1, or core_v0.19.0
# with MCORE=0.19.2, which bench/gpu/gpu_setup.sh reads: this project then runs on megatron-core
# 0.19.2 and Megatron-LM on its tag's own megatron/core; docs/mcore_versions.md):
#   on the GPU machine: MLM_DIR=/path/to/megatron-lm OUT=/some/dir bash bench/peers/megatron_lm_resume.sh [N] [M]
#     (needs .whl/ as bench/gpu/gpu_setup.sh installs it, with pydantic, pydantic_core,
#     annotated-types and typing-inspection added: Megatron-LM's training imports pydantic)
#   on the CPU: DEVICE=cpu MLM_DIR=... OUT=... bash bench/peers/megatron_lm_resume.sh 4 4
#     (Megatron-LM through this project's CUDA-to-CPU layer: a functional check, not the GPU;
#     it compiles its dataset helpers, so pybind11 must be installed, and core_v0.16.1
#     imports triton at start-up (PyPI's CUDA torch brings it); the CPU checkpoints of
#     this project hold no CUDA generator state, so Megatron-LM loads them with --no-load-rng)
#   PYTHON=/path/to/python picks the interpreter for both sides (default python3), e.g. a
#     Python 3.12 venv with megatron-core 0.19.2 for Megatron-LM at core_v0.19.0 on the CPU;
#   MLM_RESUME_FIXES=none (or 1, or 2) turns bench/peers/megatron_lm_launch.py's resume fixes off,
#     to see whether a Megatron-LM version still needs them (its log says when each acts).
set -uo pipefail
: "${MLM_DIR:?give MLM_DIR, the Megatron-LM source directory (tag core_v0.16.1 or core_v0.19.0)}"
MLM_DIR="$(cd "$MLM_DIR" && pwd)"  # absolute: the script runs from the repository root
N="${1:-20}"
M="${2:-10}"
DEVICE="${DEVICE:-cuda}"
PYTHON="${PYTHON:-python3}"
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"  # the repository root
if [ "$DEVICE" = cpu ]; then
  OUT="${OUT:-/tmp/megatron-lm-resume}"; mkdir -p "$OUT"; OUT="$(cd "$OUT" && pwd)"
  export PYTHONUNBUFFERED=1
  LAUNCH=("$PYTHON" "$HERE/megatron_lm_launch.py" --cpu)
  MLM_RNG=(--no-load-rng)
else
  . "$HERE/../gpu/gpu_setup.sh"
  LAUNCH=("$PYTHON" -m torch.distributed.run --nproc-per-node 1 --master-port "${MASTER_PORT:-29533}"
          "$HERE/megatron_lm_launch.py")
  MLM_RNG=()
fi
cd "$ROOT"  # pretrain_gpt.py is the root's
export MLM_DIR
WORK="$OUT/ckpt"
rm -rf "$WORK" && mkdir -p "$WORK"

# Megatron-LM imports six (its BERT tokenizer) at start-up; a stand-in if it is missing.
SHIM="$OUT/shim"
if ! "$PYTHON" -c "import six" 2>/dev/null; then
  mkdir -p "$SHIM"
  printf 'PY2 = False\nPY3 = True\ntext_type = str\nbinary_type = bytes\nstring_types = (str,)\n' \
      > "$SHIM/six.py"
fi
# Without Transformer Engine: megatron-core's local layers, whose linear layers need Apex
# for the fused weight-gradient accumulation (a RuntimeError there without these flags;
# this project accepts both, same math), and rope fusion is Transformer Engine's too
# (Megatron-LM's default; a ValueError there without --no-rope-fusion), and the persistent
# layer norm is Apex's (an AssertionError in the local RMSNorm without --no-persist-layer-norm).
# --attention-backend unfused: megatron-core's DotProductAttention on both sides (Megatron-LM's
# local spec has no other; this project would take torch's SDPA, ~1e-5 apart), so that the
# two compute the same thing and their checkpoints can be compared bit for bit.
IMPL=(--transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
      --no-rope-fusion --no-persist-layer-norm --attention-backend unfused)
"$PYTHON" -c "import transformer_engine" 2>/dev/null && IMPL=(--transformer-impl transformer_engine)

# The same run for both: flags grouped by concern, Megatron-LM's names and meanings.
MODEL=(--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256
       --max-position-embeddings 256 --position-embedding-type rope --normalization RMSNorm
       --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
       --hidden-dropout 0 --attention-dropout 0 "${IMPL[@]}")
DATA=(--mock-data --tokenizer-type NullTokenizer --split 969,30,1 --num-workers 0)
# NullTokenizer's --vocab-size changed meaning at Megatron-LM core_v0.18.0: it was V ids plus
# the EOD (id V; core_v0.16.1), it is V ids with the EOD the last of them (id V-1). This
# project follows the installed megatron-core's tag (runtime/mcore_compat.py). Mock data is
# made of ids modulo the vocabulary and the EOD, so the same 8191 ids + EOD (padded to 8192
# either way) is --vocab-size 8192 on each side that counts the EOD.
VOCAB=(--vocab-size "$("$PYTHON" -c 'from megatron_ext.runtime.mcore_compat import null_vocab_includes_eod as f; print(8192 if f() else 8191)' 2>/dev/null || echo 8191)")
MLM_VOCAB=(--vocab-size 8191)
if grep -q "eod_id=None" "$MLM_DIR/megatron/core/tokenizers/text/libraries/null_tokenizer.py" \
    2>/dev/null; then
  MLM_VOCAB=(--vocab-size 8192)
fi
TRAIN=(--micro-batch-size 4 --global-batch-size 16 --train-iters $((N + M)) --bf16
       --use-distributed-optimizer --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 5
       --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --seed 1234)
LOG=(--log-interval 1 --eval-iters 0 --eval-interval 1000000)
CKPT=(--ckpt-format torch_dist --save-interval "$N" --dist-ckpt-strictness log_all)

this_project() {  # this_project LOGNAME FLAGS...
  local name="$1"; shift
  "$PYTHON" pretrain_gpt.py "${MODEL[@]}" "${DATA[@]}" "${VOCAB[@]}" "${TRAIN[@]}" "${LOG[@]}" "${CKPT[@]}" \
      --device "$DEVICE" --wandb-mode disabled "$@" > "$OUT/$name.log" 2>&1
  echo "this project ($name): exit $?"
}

megatron_lm() {  # megatron_lm LOGNAME FLAGS...
  local name="$1"; shift
  PYTHONPATH="$MLM_DIR:$SHIM:$ROOT:${PYTHONPATH:-}" "${LAUNCH[@]}" \
      "${MODEL[@]}" "${DATA[@]}" "${MLM_VOCAB[@]}" "${TRAIN[@]}" "${LOG[@]}" "${CKPT[@]}" "$@" \
      > "$OUT/$name.log" 2>&1
  echo "Megatron-LM ($name): exit $?"
}

losses() {  # the 'iteration K/ T ... lm loss: X' of a log (Megatron-LM's has a time stamp before it)
  grep -E "(^|\] | )iteration +[0-9]+/" "$1" \
      | sed -E 's/.*iteration +([0-9]+)\/.*lm loss: ([0-9.E+-]+).*/\1 \2/' | tr '\n' ';'
  echo
}

{
  echo "== versions ($PYTHON, DEVICE=$DEVICE)"
  echo "this project: $("$PYTHON" -c 'import sys, torch, megatron.core as m
print("Python", sys.version.split()[0], "torch", torch.__version__, "megatron-core", m.__version__)' \
      2>/dev/null)"
  echo "Megatron-LM: $(cd "$MLM_DIR" && PYTHONPATH="$MLM_DIR" "$PYTHON" -c 'import megatron.core as m
print("its megatron/core", m.__version__, "from", m.__file__)' 2>&1 | tail -1)"
  echo "NullTokenizer: this project ${VOCAB[*]}, Megatron-LM ${MLM_VOCAB[*]} (the same tokens)"
  echo "== Megatron-LM's pretrain_gpt.py --help (imports: $MLM_DIR)"
  PYTHONPATH="$MLM_DIR:$SHIM:${PYTHONPATH:-}" "$PYTHON" "$MLM_DIR/pretrain_gpt.py" --help \
      > "$OUT/megatron_lm_help.log" 2>&1 && echo ok || tail -5 "$OUT/megatron_lm_help.log"

  echo "== 1. this project trains $N iterations and saves; Megatron-LM loads and trains $M"
  this_project this_project_first --save "$WORK/a" --exit-interval "$N"
  megatron_lm megatron_lm_resumed --load "$WORK/a" --save "$WORK/a_mlm" "${MLM_RNG[@]}"
  echo "this project, iterations 1-$N: $(losses "$OUT/this_project_first.log")"
  echo "Megatron-LM resumed: $(grep -m1 -E "successfully loaded checkpoint|loading checkpoint" \
      "$OUT/megatron_lm_resumed.log")"
  echo "Megatron-LM, iterations $((N + 1))-$((N + M)): $(losses "$OUT/megatron_lm_resumed.log")"

  echo "== reference: this project straight for $((N + M)) iterations"
  this_project this_project_straight --save "$WORK/straight"
  echo "this project straight: $(losses "$OUT/this_project_straight.log")"

  echo "== 2. Megatron-LM trains $N and saves; this project loads and trains $M"
  megatron_lm megatron_lm_first --save "$WORK/b" --exit-interval "$N"
  this_project this_project_resumed --load "$WORK/b" --save "$WORK/b_mext"
  echo "Megatron-LM, iterations 1-$N: $(losses "$OUT/megatron_lm_first.log")"
  echo "this project resumed: $(grep -m1 -E "^loaded " "$OUT/this_project_resumed.log")"
  echo "this project, iterations $((N + 1))-$((N + M)): $(losses "$OUT/this_project_resumed.log")"

  echo "== reference: Megatron-LM straight for $((N + M)) iterations"
  megatron_lm megatron_lm_straight --save "$WORK/mlm_straight"
  echo "Megatron-LM straight: $(losses "$OUT/megatron_lm_straight.log")"

  echo "== checkpoints compared tensor by tensor (model and optimizer states; bench/peers/megatron_lm_compare.py)"
  at_n="$(printf iter_%07d "$N")"; at_end="$(printf iter_%07d $((N + M)))"
  for pair in "straight/$at_n mlm_straight/$at_n" "straight/$at_end mlm_straight/$at_end" \
              "straight/$at_end a_mlm/$at_end" "mlm_straight/$at_end b_mext/$at_end"; do
    set -- $pair
    echo "$1 against $2:"
    [ -d "$WORK/$1" ] && [ -d "$WORK/$2" ] || { echo "  not both saved"; continue; }
    "$PYTHON" "$HERE/megatron_lm_compare.py" "$WORK/$1" "$WORK/$2" 2>&1 | tail -12
  done
  grep -h -E "^error|Error|Traceback" "$OUT"/*.log | head -20 || true  # none found: no failure
} 2>&1 | tee "$OUT/summary.txt"
