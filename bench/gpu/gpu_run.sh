#!/usr/bin/env bash
# One call on the lent GPU machine: install the carried wheels, run tests/gpu, benchmark the
# reference GPT, and run DeepSpeed's GPT benchmark (peer bundle) in the same command.
# Usage (repository root, on the GPU machine): OUT=/some/dir bash bench/gpu/gpu_run.sh [ds]
# Needs .whl/ (megatron-core cp312 wheel) and, for 'ds', .peers/deepspeed carried along.
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
echo "== tests/gpu"
python3 -m pytest -q tests/gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
echo "== bench: reference GPT, no offload"
python3 bench/gpu/pretrain_bench.py --iters "${BENCH_ITERS:-25}" --warmup 5 --repeats "${BENCH_REPEATS:-3}" \
    --label no-offload --output "$OUT/pretrain_no-offload.json" 2>&1 | tee "$OUT/bench.txt" | tail -8
if [ "${1:-}" = "ds" ]; then
  echo "== DeepSpeed peer, same model, torch AdamW, no offload"
  bash bench/peers/ds_setup.sh install > "$OUT/ds_setup.txt" 2>&1 || tail -5 "$OUT/ds_setup.txt"
  python3 .peers/deepspeed/zero_infinity_bench.py --offload none --layers 24 --hidden 2048 \
      --heads 16 --vocab 32000 --seq 2048 --micro-batch 4 --warmup 5 --steps 20 \
      > "$OUT/ds_none.txt" 2>&1; tail -4 "$OUT/ds_none.txt"
fi
