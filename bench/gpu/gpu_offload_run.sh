#!/usr/bin/env bash
# One call on the lent GPU machine for the offload engine: install the carried wheels, run
# tests/gpu (offload tests first), then bench/gpu/offload_bench.py with the given configurations.
# Usage (repository root, on the GPU machine):
#   OUT=/dir CONFIGS=all-off,all-on TESTS=tests/gpu/test_gpu_offload.py bash bench/gpu/gpu_offload_run.sh
# Needs .whl/ (megatron-core, xxhash, crc32c cp312 wheels) and, for deepspeed-nvme,
# .peers/deepspeed carried along.
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
if [ -n "${TESTS:-}" ]; then
  echo "== pytest $TESTS"
  python3 -m pytest -q $TESTS -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
fi
if [ -n "${CONFIGS:-}" ]; then
  case "$CONFIGS" in *deepspeed*)
    bash bench/peers/ds_setup.sh full > "$OUT/ds_setup.txt" 2>&1 || tail -5 "$OUT/ds_setup.txt";;
  esac
  python3 bench/gpu/offload_bench.py --configs "$CONFIGS" --output "$OUT/offload_bench.json" \
      --deepspeed-bundle .peers/deepspeed ${BENCH_ARGS:-} 2>&1 | tee "$OUT/offload_bench.txt" | tail -30
fi
