#!/usr/bin/env bash
# One call on the lent GPU machine for ZenFlow: install the carried wheels, optionally run
# GPU tests, set up DeepSpeed when a deepspeed-* configuration is asked for, then
# bench/gpu/zenflow_bench.py (mean step over whole update windows; see its --help).
# Usage (repository root, on the GPU machine; carry .whl and .peers):
#   OUT=/dir bash bench/gpu/gpu_zenflow_run.sh                       # all six configurations
#   OUT=/dir TESTS=tests/gpu/test_gpu_zenflow.py CONFIGS=no-offload,mcore-offload,host-only,zenflow \
#       bash bench/gpu/gpu_zenflow_run.sh
#   OUT=/dir CONFIGS=zenflow,deepspeed-zero-offload,deepspeed-zenflow bash bench/gpu/gpu_zenflow_run.sh
#   # where the delayed grads are summed (issue 20), bf16 and fp32 grads, ~4-5 min (6 runs):
#   OUT=/dir CONFIGS=no-offload+bf16grads,zenflow+device+bf16grads,zenflow+host+bf16grads,no-offload+fp32grads,zenflow+device+fp32grads,zenflow+host+fp32grads \
#       bash bench/gpu/gpu_zenflow_run.sh
# Modifiers (bench/gpu/zenflow_bench.py --help): +device/+host/+auto: --zenflow-accumulate;
# +fp32grads: --accumulate-allreduce-grads-in-fp32; +bf16grads: --grad-reduce-in-bf16 where
# pretrain_gpt.py has it (else bf16 grads are --bf16's default). The tests of the device
# accumulation on CUDA: TESTS="tests/gpu/test_gpu_zenflow.py -k accumul" CONFIGS= (~90 s).
# TESTS_LAST=1: the tests after the benchmark; TESTS_TIMEOUT: seconds for them (600);
# TESTS_ARGS: more pytest flags (e.g. "-n 6": six test processes on the one GPU, with the
# carried pytest-xdist and execnet wheels).
# CONFIGS unset: all six; CONFIGS= (empty): no benchmark (tests only). BENCH_ARGS: more
# zenflow_bench.py flags (--topk, --interval, --windows, ...). DS_SETUP=full: the bundle's
# whole setup_on_gpu.sh (also builds async_io, ~1 min more); by default only its install
# (--no-build) and the cpu_adam op that ZeRO-Offload and ZenFlow use.
# Writes $OUT/machine.txt, gpu_tests.txt, ds_setup.txt, zenflow_bench.json, zenflow_bench.txt.
#
# Time on the H200 for the 1.34B reference (default 1+3 windows of S=4: 16 steps per run;
# process start and model build ~30-40 s per megatron_ext run, ~50 s per DeepSpeed run with
# its 36 s deepspeed.initialize; step times from bench/results/2026-11-30-h200-offload and
# the DeepSpeed bundle's README):
#   gpu_setup.sh (wheels)                                  ~15 s
#   DeepSpeed setup: install + cpu_adam build (DS_SETUP=full ~120 s)   ~60 s
#   no-offload              16 x 0.19 s  =  3 s + start    ~35-45 s
#   mcore-offload           16 x 0.68 s  = 11 s + start    ~45-55 s
#   host-only               16 x 0.77 s  = 12 s + start    ~45-55 s
#   zenflow                 16 x 0.25-0.36 s (+ ~10 s first step: selection) ~45-55 s
#   deepspeed-zero-offload  16 x 1.44 s  = 23 s + start    ~75-85 s
#   deepspeed-zenflow       16 x 0.52 s  =  8 s + start    ~60-70 s
#   (2026-11-30 23:47: four configurations with the DeepSpeed setup took 240 s.)
#   tests/gpu as a whole takes more than 470 s: test_gpu_offload.py ~200-240 s,
#   test_gpu_zenflow.py ~240 s; run each in its own call.
#   all six, no TESTS: ~375-445 s: fits the 600 s limit of one call (each run is killed
#   after zenflow_bench.py's --timeout, 240 s). With TESTS (tests/gpu/test_gpu_offload.py
#   alone took 200-240 s) split into two calls: TESTS + no-offload,mcore-offload,host-only,
#   zenflow (~200 s + tests), then zenflow,deepspeed-zero-offload,deepspeed-zenflow (~250 s;
#   zenflow again as the link between the two machines).
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
CONFIGS="${CONFIGS-no-offload,mcore-offload,host-only,zenflow,deepspeed-zero-offload,deepspeed-zenflow}"
run_tests() {
  [ -n "${TESTS:-}" ] || return 0
  echo "== pytest $TESTS ($(date -u +%H:%M:%S))"
  timeout "${TESTS_TIMEOUT:-600}" python3 -m pytest -q $TESTS ${TESTS_ARGS:-} -p no:cacheprovider 2>&1 \
      | tee "$OUT/gpu_tests.txt" | tail -15
}
[ -n "${TESTS_LAST:-}" ] || run_tests
if [ -n "$CONFIGS" ]; then
  case "$CONFIGS" in *deepspeed*)
    echo "== DeepSpeed setup ($(date -u +%H:%M:%S))"
    bash bench/peers/ds_setup.sh "$([ "${DS_SETUP:-}" = full ] && echo full || echo cpu)" \
        > "$OUT/ds_setup.txt" 2>&1 || tail -5 "$OUT/ds_setup.txt"
    tail -1 "$OUT/ds_setup.txt";;
  esac
  echo "== zenflow_bench.py --configs $CONFIGS ${BENCH_ARGS:-} ($(date -u +%H:%M:%S))"
  python3 bench/gpu/zenflow_bench.py --configs "$CONFIGS" --output "$OUT/zenflow_bench.json" \
      --deepspeed-bundle .peers/deepspeed ${BENCH_ARGS:-} 2>&1 | tee "$OUT/zenflow_bench.txt" | tail -30
  echo "== done ($(date -u +%H:%M:%S))"
fi
[ -z "${TESTS_LAST:-}" ] || run_tests
