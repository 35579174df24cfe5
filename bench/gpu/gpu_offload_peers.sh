#!/usr/bin/env bash
# Issue 15's 6.7B row with its two peers, in one command on one H200 machine:
#   1. this engine: the 6.7B GPT (32 layers, hidden 4096, 32 heads; 6.6B parameters, 79 GB of
#      fp32 state) in its tiers (bench/gpu/gpu_offload_large.sh MODEL=6.7b: device tier auto,
#      the rest in the pinned host cache, streamed GPU update on);
#   2. megatron-core's --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d on the same
#      model and flags (TIERS=mcore), each --optimizer-offload-fraction of FRACTIONS from
#      the first until one trains all ITERS iterations (the largest fraction that fits);
#   3. DeepSpeed ZeRO-3 (the bundle's zero_infinity_bench.py, --offload DS_OFFLOAD: cpu or
#      nvme on the root disk), each LAYERSxHIDDENxHEADS of DS_SHAPES from the first until one
#      trains (the largest GPT it trains here), seq 2048, micro-batch 1, its own untied GPT.
#      The 13B shape is not tried by default: ZeRO-3's CPU offload keeps ~16 bytes per
#      parameter in host memory (fp32 master, two moments, fp32 gradients): 204 GB for
#      12.76B against 125 GiB here, and its NVMe offload would need 153 GB on a 64 GiB disk.
#      Nor is 36x4096x32 (7.52B) since 2026-12-02 17:07 UTC: it was killed in its first
#      step as 32x4096x32 (6.71B) was, and 24x4096x32 (5.10B) trained
#      (bench/results/2026-12-02c-h200); the failed try cost ~120 s of the deadline.
# Rows 1 and 2: global batch GBS (default 64) of micro-batch 1, full recompute, bf16 with
# --grad-reduce-in-bf16 (bf16 gradient buffer, as the large rows); the DeepSpeed bundle has
# no gradient accumulation, so its rows step per micro-batch: compare tokens/s.
# Each try has its own time limit (LIMIT for this engine, TRY_LIMIT for each peer try), cut
# to what is left of DEADLINE seconds (default 585: the whole script fits one 600 s device
# command); a try with less than MIN_TRY seconds left (default 90) is not started and the
# summary says so.
# Time on the H200 (2026-12-02, bench/results/2026-12-02c-h200 call 1 and 3): this engine's
# row ~90 s, megatron-core at 1.0 ~175 s, DeepSpeed's install and cpu_adam build ~60 s, a
# killed DeepSpeed try ~120 s, the 5.10B try ~120 s: ~560 s with the default shapes (run it
# as `timeout 598 bash bench/gpu/gpu_offload_peers.sh`; a slower machine may cut the last try).
# Writes $OUT/{gpt-6.7b,mcore-F}.{jsonl,txt}, $OUT/deepspeed-SHAPE.txt, $OUT/summary.txt.
# Usage (repository root, on the GPU machine; carry .whl and .peers):
#   OUT=/dir bash bench/gpu/gpu_offload_peers.sh
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$HERE/../.."  # the repository root: .peers/ is its
ITERS="${ITERS:-3}"
FRACTIONS="${FRACTIONS:-1.0 0.9 0.8 0.7 0.6 0.5}"
DS_SHAPES="${DS_SHAPES:-32x4096x32 24x4096x32 24x2048x16}"
DS_OFFLOAD="${DS_OFFLOAD:-cpu}"
TRY_LIMIT="${TRY_LIMIT:-200}"
DEADLINE="${DEADLINE:-585}"
MIN_TRY="${MIN_TRY:-90}"
SUMMARY="$OUT/summary.txt"
START=$SECONDS

limit() {  # limit WANT: WANT seconds, or what is left before DEADLINE; empty when too little
  local left=$((DEADLINE - (SECONDS - START)))
  if [ "$left" -lt "$MIN_TRY" ]; then return 1; fi
  if [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}

row() {  # row NAME JSONL: the mean step of the iterations after the first
  python3 - "$1" "$2" <<'EOF' | tee -a "$SUMMARY"
import json, sys
name, path = sys.argv[1:]
try:
    rows = [json.loads(l) for l in open(path) if l.strip()]
except OSError:
    rows = []
rows = [r for r in rows if "time/iteration_s" in r][1:]
if not rows:
    print(f"{name}: did not train past its first iteration")
else:
    steps = [r["time/iteration_s"] for r in rows]
    print(f"{name}: step s {', '.join(f'{s:.2f}' for s in steps)} (n={len(steps)}), "
          f"tokens/s {', '.join(str(round(r.get('throughput/tokens_per_s', 0))) for r in rows)}, "
          f"GPU max {max(r.get('memory/gpu_max_allocated_gib', 0) for r in rows):.1f} GiB, "
          f"host RSS {max(r.get('memory/host_rss_gib', 0) for r in rows):.1f} GiB")
EOF
}

: > "$SUMMARY"
echo "== 1. this engine, the 6.7B GPT in its tiers" | tee -a "$SUMMARY"
OUT="$OUT" MODEL=6.7b GBS="${GBS:-64}" ITERS="$ITERS" LIMIT="$(limit "${LIMIT:-200}")" \
    bash "$HERE/gpu_offload_large.sh" > "$OUT/engine.log" 2>&1
row "this engine" "$OUT/gpt-6.7b.jsonl"

echo "== 2. megatron-core --optimizer-cpu-offload, fractions $FRACTIONS" | tee -a "$SUMMARY"
for f in $FRACTIONS; do
  t=$(limit "$TRY_LIMIT") || { echo "megatron-core fraction $f: not tried (DEADLINE)" |
                               tee -a "$SUMMARY"; break; }
  OUT="$OUT" MODEL=6.7b TIERS=mcore FRACTION="$f" NAME="mcore-$f" GBS="${GBS:-64}" \
      ITERS="$ITERS" LIMIT="$t" bash "$HERE/gpu_offload_large.sh" > "$OUT/mcore-$f.log" 2>&1
  row "megatron-core fraction $f" "$OUT/mcore-$f.jsonl"
  tail -1 "$SUMMARY" | grep -q "did not train" || break
  grep -h -m1 -E "^error|OutOfMemory|out of memory|Killed" "$OUT/mcore-$f.txt" "$OUT/mcore-$f.log" \
      2>/dev/null | head -1 | sed 's/^/   /' | tee -a "$SUMMARY"
done

echo "== 3. DeepSpeed ZeRO-3 --offload $DS_OFFLOAD, shapes $DS_SHAPES" | tee -a "$SUMMARY"
# --offload cpu needs only DeepSpeed's install and its cpu_adam op (~45 s to build); nvme
# needs the bundle's whole setup (async_io too, ~1 min more).
bash "$HERE/../peers/ds_setup.sh" "$([ "$DS_OFFLOAD" = cpu ] && echo cpu || echo full)" \
    > "$OUT/ds_setup.txt" 2>&1 || tail -5 "$OUT/ds_setup.txt"
tail -1 "$OUT/ds_setup.txt" | tee -a "$SUMMARY"
for shape in $DS_SHAPES; do
  t=$(limit "$TRY_LIMIT") || { echo "DeepSpeed $shape: not tried (DEADLINE)" |
                               tee -a "$SUMMARY"; break; }
  IFS=x read -r layers hidden heads <<< "$shape"
  swap=/var/tmp/deepspeed-swap; rm -rf "$swap"; mkdir -p "$swap"
  timeout "$t" python3 .peers/deepspeed/zero_infinity_bench.py --offload "$DS_OFFLOAD" \
      --nvme-path "$swap" --layers "$layers" --hidden "$hidden" --heads "$heads" --vocab 32000 \
      --seq 2048 --micro-batch 1 --activation-checkpointing --warmup 1 --steps "$((ITERS - 1))" \
      > "$OUT/deepspeed-$shape.txt" 2>&1
  rc=$?
  rm -rf "$swap"
  last=$(grep -E '^\{' "$OUT/deepspeed-$shape.txt" | tail -1)
  if [ "$rc" = 0 ] && [ -n "$last" ]; then
    echo "DeepSpeed $shape: $last" | tee -a "$SUMMARY"
    break
  fi
  why=$(grep -m1 -E "Error|error|Killed" "$OUT/deepspeed-$shape.txt" | cut -c1-200)
  case "$rc" in
    124) why="the try's time limit ($t s) ${why}" ;;
    137) why="SIGKILL (not the time limit: that is rc 124), most likely the kernel's OOM \
killer; dmesg: $(dmesg 2>/dev/null | grep -i -E "out of memory|oom-kill" | tail -1 | cut -c1-160) ${why}" ;;
  esac
  echo "DeepSpeed $shape: failed (rc $rc): $why" | tee -a "$SUMMARY"
done
echo "total $((SECONDS - START)) s" | tee -a "$SUMMARY"
