#!/usr/bin/env bash
# The 6.7B GPT (32 layers, hidden 4096, seq 2048, micro-batch 1, bf16) fine-tuned with
# ZenFlow (k=0.1, S=4) with its CPU side's states in the offload engine's tiers: a host
# cache of CACHE_GB and the rest on the root disk (O_DIRECT). Sized for the H200 machine
# (125 GiB RAM, 64 GiB free disk): the CPU side holds ~5.9G delayed elements: accumulators
# 8 B, upload 2 B and one staging slot 2 B each in host memory (~71 GB), fp32 master and
# moments 12 B each (~71 GB) in the tiers. Every subgroup that the root disk cannot hold
# (~65 GB free) stays in the host cache without a file (CACHE_GB covers them and three
# pipeline buffers). Call 3 of bench/results/2026-12-01-h200-zenflow ran before the cache
# could do that, with PATHS="$TIER@10,10 /dev/shm/zenflow-tier@0.1,0.1" and
# EXTRA=--no-offload-rebalance (/dev/shm, host memory, took the 7 GB that did not fit).
# Writes $OUT/zenflow6.7b.{jsonl,txt} and $OUT/memory.txt (free -g and the disk every 15 s).
# Usage (repository root, on the GPU machine; carry .whl): OUT=/dir bash bench/gpu/gpu_zenflow_large.sh
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
TIER="${TIER:-/var/tmp/zenflow-tier}"
PATHS="${PATHS:-$TIER}"
EXTRA="${EXTRA:-}"
mkdir -p "$TIER"
( while true; do { date -u +%H:%M:%S; free -g | sed -n 2p; df -h "$TIER" | tail -1; \
    du -sh /dev/shm/zenflow-tier 2>/dev/null; } >> "$OUT/memory.txt"; sleep 15; done ) &
MONITOR=$!
export MEGATRON_EXT_ZENFLOW_STAGING_SLOTS="${SLOTS:-1}"
# 32000 ids + EOD on every megatron-core (NullTokenizer's --vocab-size counts the EOD from 0.18).
VOCAB="$(python3 -c 'from megatron_ext.runtime.mcore_compat import null_vocab_includes_eod as f; print(32001 if f() else 32000)')"
timeout "${LIMIT:-470}" python3 pretrain_gpt.py --num-layers 32 --hidden-size 4096 \
    --num-attention-heads 32 --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size 1 --mock-data --vocab-size "$VOCAB" --bf16 --grad-reduce-in-bf16 --lr-decay-style cosine --num-workers 0 \
    --use-distributed-optimizer \
    --lr 1e-5 --min-lr 1e-6 --lr-warmup-iters 2 --log-interval 1 --eval-iters 0 \
    --wandb-mode disabled --hidden-dropout 0 --attention-dropout 0 \
    --zenflow --zenflow-topk-ratio 0.1 --zenflow-update-interval 4 \
    --zenflow-select-interval 100 --offload-optimizer --offload-paths $PATHS $EXTRA \
    --offload-host-cache-gb "${CACHE_GB:-16}" --offload-direct-io --offload-io-threads 8 \
    --train-iters "${ITERS:-8}" --metrics-path "$OUT/zenflow6.7b.jsonl" 2>&1 \
    | grep -v "UserWarning\|warnings.warn\|return func" | tee "$OUT/zenflow6.7b.txt" | tail -25
echo "rc=${PIPESTATUS[0]}" | tee -a "$OUT/zenflow6.7b.txt"
kill $MONITOR
tail -3 "$OUT/memory.txt"
