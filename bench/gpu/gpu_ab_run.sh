#!/usr/bin/env bash
# A/B of the offload engine between two checkouts in one command on the lent GPU machine:
# bench/gpu/offload_bench.py of tree A (BASE, another checkout of this project, e.g. an older
# commit from `git archive`) and of this tree, alternating A B A B ..., ROUNDS times, on the
# same disk and model, so that the machine's drift falls on both alike.
# Usage (repository root, on the GPU machine):
#   OUT=/dir BASE=.old ROUNDS=2 CONFIGS=all-on BENCH_ARGS="--iters 4 --warmup 1" \
#       bash bench/gpu/gpu_ab_run.sh
# Needs .whl/ carried (as bench/gpu/gpu_setup.sh); writes $OUT/ab_{a,b}_N.json and ab.txt.
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
: "${BASE:?give BASE=the other checkout}"
ROUNDS="${ROUNDS:-2}"
CONFIGS="${CONFIGS:-all-on}"
HERE="$PWD"
for round in $(seq 1 "$ROUNDS"); do
  for side in a b; do
    tree="$HERE"; [ "$side" = a ] && tree="$BASE"
    echo "== round $round side $side ($tree)"
    # An older tree may have the flat bench/ layout (before bench/gpu/).
    bench=bench/gpu/offload_bench.py; [ -f "$tree/$bench" ] || bench=bench/offload_bench.py
    (cd "$tree" && python3 "$bench" --configs "$CONFIGS" \
        --output "$OUT/ab_${side}_${round}.json" ${BENCH_ARGS:-} 2>&1 | tail -4)
  done
done | tee "$OUT/ab.txt"
