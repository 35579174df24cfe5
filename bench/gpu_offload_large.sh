#!/usr/bin/env bash
# The largest GPT this engine trains on one H200 machine (125 GiB RAM, 64 GiB free disk):
# MODEL=13b (40 layers, hidden 5120, 40 heads: ~12.9B parameters, ~154 GB of fp32 master
# and Adam moments) or MODEL=6.7b (32 layers, hidden 4096), seq 2048, micro-batch 1, bf16,
# distributed optimizer, mock data, every optimizer state off the GPU (--offload-optimizer).
# 154 GB of state exceed the disk's free space: PATHS puts the root disk first with a high
# declared bandwidth (placement fills it up to its free space) and /dev/shm second with a
# low one (the rest). /dev/shm is host memory: here it holds the part of the states that
# neither the disk nor a file-less cache can (every subgroup has a file on some path; the
# host cache is a cache); it is NOT a stand-in for a faster storage device.
# --no-offload-rebalance keeps the declared numbers from moving subgroups. Writes
# $OUT/gpt-$MODEL.{jsonl,txt} and $OUT/memory.txt (free -g, disk, /dev/shm every 15 s).
# Usage (repository root, on the GPU machine; carry .whl):
#   OUT=/dir MODEL=13b ITERS=3 bash bench/gpu_offload_large.sh
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
MODEL="${MODEL:-13b}"
case "$MODEL" in
  13b) SHAPE=(--num-layers 40 --hidden-size 5120 --num-attention-heads 40) ;;
  6.7b) SHAPE=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32) ;;
  *) echo "MODEL must be 13b or 6.7b"; exit 2 ;;
esac
TIER="${TIER:-/var/tmp/offload-tier}"
SHM=/dev/shm/offload-tier
PATHS="${PATHS:-$TIER@10,10 $SHM@0.1,0.1}"
mkdir -p "$TIER" "$SHM"
( while true; do { date -u +%H:%M:%S; free -g | sed -n 2p; df -h "$TIER" | tail -1; \
    du -sh "$SHM" 2>/dev/null; } >> "$OUT/memory.txt"; sleep 15; done ) &
MONITOR=$!
timeout "${LIMIT:-480}" python3 pretrain_gpt.py "${SHAPE[@]}" --seq-length 2048 \
    --max-position-embeddings 2048 --micro-batch-size 1 --mock-data --vocab-size 32000 \
    --bf16 --use-distributed-optimizer --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 1 \
    --log-interval 1 --eval-iters 0 --wandb-mode disabled --hidden-dropout 0 \
    --attention-dropout 0 --offload-optimizer --offload-paths $PATHS \
    --no-offload-rebalance --offload-host-cache-gb "${CACHE_GB:-3.6}" --offload-direct-io \
    --offload-io-threads 8 --train-iters "${ITERS:-3}" --metrics-path "$OUT/gpt-$MODEL.jsonl" \
    2>&1 | grep -v "UserWarning\|warnings.warn\|return func" | tee "$OUT/gpt-$MODEL.txt" | tail -25
echo "rc=${PIPESTATUS[0]}" | tee -a "$OUT/gpt-$MODEL.txt"
kill $MONITOR
tail -4 "$OUT/memory.txt"
