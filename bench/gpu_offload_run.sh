#!/usr/bin/env bash
# One call on the lent GPU machine for the offload engine: install the carried wheels, run
# tests/gpu (offload tests first), then bench/offload_bench.py with the given configurations.
# Usage (repository root, on the GPU machine):
#   OUT=/dir CONFIGS=all-off,all-on TESTS=tests/gpu/test_gpu_offload.py bash bench/gpu_offload_run.sh
# Needs .whl/ (megatron-core, xxhash, crc32c cp312 wheels) and, for deepspeed-nvme,
# .peers/deepspeed carried along.
set -uo pipefail
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/mext-site .whl/*.whl || { echo "wheel install failed"; exit 1; }
export PYTHONPATH="/tmp/mext-site${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)" 2>/dev/null
  nproc; free -g | head -2; df -h / /dev/shm | tail -2
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
if [ -n "${TESTS:-}" ]; then
  echo "== pytest $TESTS"
  python3 -m pytest -q $TESTS -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
fi
if [ -n "${CONFIGS:-}" ]; then
  case "$CONFIGS" in *deepspeed*)
    bash .peers/deepspeed/setup_on_gpu.sh > "$OUT/ds_setup.txt" 2>&1 || tail -5 "$OUT/ds_setup.txt";;
  esac
  python3 bench/offload_bench.py --configs "$CONFIGS" --output "$OUT/offload_bench.json" \
      --deepspeed-bundle .peers/deepspeed ${BENCH_ARGS:-} 2>&1 | tee "$OUT/offload_bench.txt" | tail -30
fi
