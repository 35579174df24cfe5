#!/usr/bin/env bash
# The largest GPT this engine trains on one H200 machine (125 GiB RAM, 64 GiB free disk):
# MODEL=13b (40 layers, hidden 5120, 40 heads: ~12.9B parameters, ~154 GB of fp32 master
# and Adam moments) or MODEL=6.7b (32 layers, hidden 4096), seq 2048, micro-batch 1, bf16,
# distributed optimizer, mock data, every optimizer state off the GPU (--offload-optimizer).
# 154 GB of state exceed the root disk's free space (~65 GB): the host cache (CACHE_GB,
# pinned) keeps the subgroups that the disk cannot hold, without a file (the engine's rule
# when the paths are too small), and three more buffers for the pipeline. PATHS can add
# other directories (DIR@READ,WRITE ...). Writes $OUT/gpt-$MODEL.{jsonl,txt} and
# $OUT/memory.txt (free -g and the disk every 15 s).
# Usage (repository root, on the GPU machine; carry .whl):
#   OUT=/dir MODEL=13b ITERS=3 bash bench/gpu_offload_large.sh
# Host memory for 13B: ~100 GB of pinned cache + the process (~8 GB) of 125 GiB.
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
MODEL="${MODEL:-13b}"
case "$MODEL" in
  13b) SHAPE=(--num-layers 40 --hidden-size 5120 --num-attention-heads 40) ;;
  6.7b) SHAPE=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32) ;;
  *) echo "MODEL must be 13b or 6.7b"; exit 2 ;;
esac
TIER="${TIER:-/var/tmp/offload-tier}"
PATHS="${PATHS:-$TIER}"
mkdir -p "$TIER"
( while true; do { date -u +%H:%M:%S; free -g | sed -n 2p; df -h "$TIER" | tail -1; } \
    >> "$OUT/memory.txt"; sleep 15; done ) &
MONITOR=$!
timeout "${LIMIT:-480}" python3 pretrain_gpt.py "${SHAPE[@]}" --seq-length 2048 \
    --max-position-embeddings 2048 --micro-batch-size 1 --mock-data --vocab-size 32000 \
    --bf16 --grad-reduce-in-bf16 --lr-decay-style cosine --num-workers 0 \
    --use-distributed-optimizer --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 1 \
    --log-interval 1 --eval-iters 0 --wandb-mode disabled --hidden-dropout 0 \
    --attention-dropout 0 --offload-optimizer --offload-paths $PATHS \
    --offload-host-cache-gb "${CACHE_GB:-100}" --offload-direct-io \
    --offload-io-threads 8 --train-iters "${ITERS:-3}" --metrics-path "$OUT/gpt-$MODEL.jsonl" \
    2>&1 | grep -v "UserWarning\|warnings.warn\|return func" | tee "$OUT/gpt-$MODEL.txt" | tail -25
echo "rc=${PIPESTATUS[0]}" | tee -a "$OUT/gpt-$MODEL.txt"
kill $MONITOR
tail -4 "$OUT/memory.txt"
