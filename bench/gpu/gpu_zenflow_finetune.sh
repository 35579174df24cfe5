#!/usr/bin/env bash
# ZenFlow's accuracy in a fine-tune on the lent H200 (issue 29): one call per PART, each
# building its byte-level corpora and pretraining the 1.34B reference GPT (seq 1024, batch 8)
# for 150 Adam steps again (a call starts on a fresh machine), then fine-tuning 100 steps on
# Python's documentation prose (bench/gpu/zenflow_finetune.py --help).
# Usage (repository root, on the GPU machine; carry .whl, and .peers for PART=deepspeed):
#   OUT=/dir PART=ours bash bench/gpu/gpu_zenflow_finetune.sh        # adam, zenflow x seeds 1 2 3
#   OUT=/dir PART=ours-extra bash bench/gpu/gpu_zenflow_finetune.sh  # adam s1, zenflow-auto, -paper
#   OUT=/dir PART=deepspeed bash bench/gpu/gpu_zenflow_finetune.sh   # ds-adam, ds-zenflow x 3 seeds
# ARGS: more bench/gpu/zenflow_finetune.py flags (e.g. "--seeds 1 2 --finetune-iters 80");
# LIMIT_S: seconds after which no run starts that would not end (default 540).
# Writes into $OUT: machine.txt, finetune.log (every command and its output), runs.json,
# summary.md, summary.csv, val_loss.png (if matplotlib is there), ds_setup.txt (deepspeed).
#
# Expected time (H200; start-up ~30-40 s per pretrain_gpt.py process, step ~0.19 s without
# offload and ~0.2-0.25 s with ZenFlow at this shape; DeepSpeed: ZenFlow mean ~0.52 s,
# its ZeRO-2 Adam ~0.22 s, ~40 s per deepspeed.initialize with the CPU optimizer):
#   setup (wheels) ~15 s, data ~30-60 s, pretrain 150 steps + start + save ~90 s
#   ours:       6 fine-tunes x (~35 s start + 100 x ~0.2 s + 6 evaluations) ~= 6 x 60 s
#               -> ~8 min
#   ours-extra: 3 fine-tunes -> ~5 min
#   deepspeed:  bundle setup ~60 s, one process: pretrain ~60 s, 3 x ds-adam ~40 s,
#               3 x ds-zenflow ~100 s -> ~8-9 min (ARGS="--seeds 1 2" if tight)
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
PART="${PART:-ours}"
EXTRA=()
if [ "$PART" = deepspeed ]; then
  echo "== DeepSpeed setup ($(date -u +%H:%M:%S))"
  bash bench/peers/ds_setup.sh cpu > "$OUT/ds_setup.txt" 2>&1 || tail -5 "$OUT/ds_setup.txt"
  tail -1 "$OUT/ds_setup.txt"
  EXTRA=(--ds-bundle .peers/deepspeed)
fi
# Runs that would end after ~9 min from the call's start (LIMIT_S, by the last run's time)
# are skipped and recorded as skipped: the call ends with whole runs and its files.
DEADLINE=$(( ${LIMIT_S:-540} - SECONDS ))
echo "== zenflow_finetune.py --part $PART ${ARGS:-} --deadline $DEADLINE ($(date -u +%H:%M:%S))"
# shellcheck disable=SC2086
python3 bench/gpu/zenflow_finetune.py --part "$PART" --output-dir "$OUT" --work-dir /tmp/zf-finetune \
    --deadline "$DEADLINE" "${EXTRA[@]}" ${ARGS:-} 2>&1 | tail -40
echo "== done ($(date -u +%H:%M:%S))"
