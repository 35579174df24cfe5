#!/usr/bin/env bash
# The largest GPTs this engine trains on one H200 machine (139 GiB GPU, 125 GiB RAM, 64 GiB
# free disk, 16 cores): bf16, distributed optimizer, mock data, seq 2048, every fp32 master
# and Adam moment in the offload engine's hierarchy of tiers (--offload-optimizer).
#
# MODEL (parameters with the 32k vocabulary; fp32 state = 12 bytes per parameter):
#   13b    40 layers, hidden 5120, 40 heads:  12.76B, 153 GB of state
#   6.7b   32 layers, hidden 4096, 32 heads:   6.6B,   79 GB
#   16b    36 layers, hidden 6144, 48 heads:  16.5B,  198 GB (fp32), 132 GB (MOMENTS=bf16)
#   18b    40 layers, hidden 6144, 48 heads:  18.3B,  219 GB (fp32), 146 GB (MOMENTS=bf16)
#   20b    44 layers, hidden 6144, 48 heads:  20.1B,  242 GB (fp32), 161 GB (MOMENTS=bf16)
#   25b    56 layers, hidden 6144, 48 heads:  25.6B,  307 GB (fp32), 205 GB (MOMENTS=bf16)
# (at 12 and 8 bytes per element; with the default remainders 10 and 6: 20b 201/121 GB,
# 25b 256/153 GB)
# TIERS:
#   device (default)  --offload-device-cache-gb auto (GPU memory left after the measured
#                     forward+backward peak and DEVICE_RESERVE_GB), the rest in the pinned
#                     host cache (CACHE_GB if given, else all of it), PATHS only if given;
#                     streamed GPU update of host subgroups on (GPU_UPDATE=0: off)
#   host              the old layout: no device tier, CACHE_GB (default 100) pinned + PATHS
#                     (default the root disk)
#   auto              --offload-optimizer alone: every size auto (the memory plan's device
#                     budget, the host cache from MemAvailable, PATHS only if given)
#   plain             no offload at all (plain megatron-core; the memory plan refuses what
#                     cannot fit; PLAN_CHECK=0 adds --no-plan-check to meet the OOM itself)
#   mcore             not this engine: megatron-core's --optimizer-cpu-offload with
#                     --optimizer-offload-fraction FRACTION (default 1.0) and
#                     --overlap-cpu-optimizer-d2h-h2d (HybridDeviceOptimizer), for the peer row
# MOMENTS=bf16: --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16
# (8 bytes per element instead of 12; MOMENTS=fp32, the default: exact fp32 states).
# GBS (global batch, default 64) of MBS (micro-batch, default 1) sequences of 2048;
# RECOMPUTE=1 (default) recomputes whole layers (the activations of one micro-batch of the
# 13B without it: ~15 GB, taken from the device tier). --grad-reduce-in-bf16 is passed when
# this build has it (bf16 gradient buffer: 2 bytes per parameter instead of 4).
# Writes $OUT/$NAME.{jsonl,txt} and $OUT/memory.txt (free -g, disk, nvidia-smi every 15 s).
# Usage (repository root, on the GPU machine; carry .whl):
#   OUT=/dir MODEL=13b ITERS=4 bash bench/gpu/gpu_offload_large.sh
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
MODEL="${MODEL:-13b}"
NAME="${NAME:-gpt-$MODEL}"  # the output files: $OUT/$NAME.{jsonl,txt}
case "$MODEL" in
  13b) SHAPE=(--num-layers 40 --hidden-size 5120 --num-attention-heads 40) ;;
  6.7b) SHAPE=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32) ;;
  16b) SHAPE=(--num-layers 36 --hidden-size 6144 --num-attention-heads 48) ;;
  18b) SHAPE=(--num-layers 40 --hidden-size 6144 --num-attention-heads 48) ;;
  20b) SHAPE=(--num-layers 44 --hidden-size 6144 --num-attention-heads 48) ;;
  25b) SHAPE=(--num-layers 56 --hidden-size 6144 --num-attention-heads 48) ;;
  *) echo "MODEL must be 13b, 6.7b, 16b, 18b, 20b or 25b"; exit 2 ;;
esac
TIERS="${TIERS:-device}"
TIER="${TIER:-/var/tmp/offload-tier}"
EXTRA=()
case "$TIERS" in
  device)
    PATHS="${PATHS:-}"
    # DEVICE_GB: a fixed device tier instead of auto (needed when the host cache and the
    # paths cannot hold every subgroup before the first step sizes an auto tier).
    EXTRA+=(--offload-device-cache-gb "${DEVICE_GB:-auto}"
            --offload-device-reserve-gb "${DEVICE_RESERVE_GB:-4}")
    [ -n "${CACHE_GB:-}" ] && EXTRA+=(--offload-host-cache-gb "$CACHE_GB")
    [ "${GPU_UPDATE:-1}" = 0 ] && EXTRA+=(--no-offload-gpu-update) ;;
  auto)
    PATHS="${PATHS:-}" ;;
  plain)
    PATHS=""
    [ "${PLAN_CHECK:-1}" = 0 ] && EXTRA+=(--no-plan-check) ;;
  host)
    PATHS="${PATHS:-$TIER}"
    EXTRA+=(--offload-host-cache-gb "${CACHE_GB:-100}" --no-offload-gpu-update) ;;
  mcore)
    PATHS=""
    EXTRA+=(--optimizer-cpu-offload --optimizer-offload-fraction "${FRACTION:-1.0}"
            --overlap-cpu-optimizer-d2h-h2d) ;;
  *) echo "TIERS must be device, auto, plain, host or mcore"; exit 2 ;;
esac
OFFLOAD=(--offload-optimizer)
case "$TIERS" in mcore|plain) OFFLOAD=() ;; esac
if [ -n "$PATHS" ]; then
  mkdir -p "$TIER"
  EXTRA+=(--offload-paths $PATHS --offload-direct-io --offload-io-threads 8)
fi
case "${MOMENTS:-fp32}" in
  fp32) ;;
  bf16) EXTRA+=(--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16) ;;
  *) echo "MOMENTS must be fp32 or bf16"; exit 2 ;;
esac
[ "${RECOMPUTE:-1}" = 1 ] && EXTRA+=(--recompute-granularity full --recompute-method uniform \
                                     --recompute-num-layers 1)
if python3 pretrain_gpt.py --help 2>/dev/null | grep -q -- "--grad-reduce-in-bf16"; then
  EXTRA+=(--grad-reduce-in-bf16)
fi
( while true; do { date -u +%H:%M:%S; free -g | sed -n 2p; df -h "${TIER%/*}" | tail -1
    nvidia-smi --query-gpu=memory.used --format=csv,noheader; } >> "$OUT/memory.txt"
    sleep 15; done ) &
MONITOR=$!
# 32000 ids + EOD (padded to 32128) on every megatron-core: NullTokenizer's --vocab-size
# counts the EOD from 0.18 (runtime/mcore_compat.py), so that is 32001 there.
VOCAB="$(python3 -c 'from megatron_ext.runtime.mcore_compat import null_vocab_includes_eod as f; print(32001 if f() else 32000)')"
set -x
timeout "${LIMIT:-540}" python3 pretrain_gpt.py "${SHAPE[@]}" --seq-length 2048 \
    --max-position-embeddings 2048 --micro-batch-size "${MBS:-1}" \
    --global-batch-size "${GBS:-64}" --mock-data --vocab-size "$VOCAB" \
    --bf16 --use-distributed-optimizer --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 1 \
    --lr-decay-style cosine --num-workers 0 --log-interval 1 --eval-iters 0 --eval-interval 1000 \
    --wandb-mode disabled --hidden-dropout 0 --attention-dropout 0 "${OFFLOAD[@]}" \
    "${EXTRA[@]}" --train-iters "${ITERS:-4}" --metrics-path "$OUT/$NAME.jsonl" \
    2>&1 | grep -v "UserWarning\|warnings.warn\|return func" | tee "$OUT/$NAME.txt" | tail -25
echo "rc=${PIPESTATUS[0]}" | tee -a "$OUT/$NAME.txt"
set +x
kill $MONITOR
tail -4 "$OUT/memory.txt"
# Step time against its own forward+backward (the target: within 1.25x).
python3 - "$OUT/$NAME.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if "time/iteration_s" in r]
for r in rows[1:]:
    step = r["time/iteration_s"]
    fb = sum(r.get(k, 0.0) for k in ("time/forward_s", "time/backward_s"))
    keys = {k: r[k] for k in r if k.startswith(("offload/device", "offload/stream",
                                                  "offload/update", "offload/stall",
                                                  "offload/io_floor", "offload/roofline",
                                                  "offload/host_cache", "memory/"))}
    print("iteration", r.get("iteration"), "step s", step, "fwd+bwd s", round(fb, 3),
          "ratio", round(step / fb, 3) if step and fb else None, keys)
EOF
