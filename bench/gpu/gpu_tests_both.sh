#!/usr/bin/env bash
# tests/gpu on megatron-core 0.19.2 and 0.16.1 in one device call, one summary.
#
# Usage (repository root, on the lent GPU machine; .whl/ carried with the cp312 wheels of
# megatron-core 0.19.2 and 0.16.1, crc32c, wandb; see docs/mcore_versions.md):
#   OUT=$OUT COMMIT=<git commit of the tree> bash bench/gpu/gpu_tests_both.sh
# Knobs: VERSIONS (default "0.19.2 0.16.1": 0.19.2 is what a Python 3.12 user installs, so
# it goes first), TESTS (default tests/gpu), WORKERS (pytest-xdist processes, default 8: the
# tiny models need little of the GPU, the machine has 16 cores), LIMIT (seconds per
# version, default 270: both fit one 10-minute call with the installs), TEST_TIMEOUT (seconds
# one test may take when the pytest-timeout wheel is carried, default 200).
# Writes under $OUT: tests-<version>.txt (pytest's whole output), machine-<version>.txt,
# host_memory.txt (free -m every 5 s: a run that starves the host loses every result of the
# call) and summary.txt (the command, date, machine, commit and each version's pytest
# summary line). The exit status is 0 only when every version ran with 0 failed.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$HERE/../.."  # the repository root: TESTS and git are its
VERSIONS="${VERSIONS:-0.19.2 0.16.1}"
TESTS="${TESTS:-tests/gpu}"
WORKERS="${WORKERS:-8}"
LIMIT="${LIMIT:-270}"
TEST_TIMEOUT="${TEST_TIMEOUT:-200}"
COMMIT="${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
( while true; do date -u +%H:%M:%S; free -m | sed -n 2p; sleep 5; done ) \
    > "$OUT/host_memory.txt" 2>&1 &
WATCH=$!
trap 'kill $WATCH 2>/dev/null' EXIT
{
  echo "command: OUT=\$OUT VERSIONS='$VERSIONS' TESTS='$TESTS' WORKERS=$WORKERS LIMIT=$LIMIT bash bench/gpu/gpu_tests_both.sh"
  echo "commit: $COMMIT"
  echo "started: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
} > "$OUT/summary.txt"
status=0
for version in $VERSIONS; do
  # gpu_setup.sh installs this megatron-core into a folder of its own and puts it first on
  # PYTHONPATH (the other wheels once); machine.txt names the version that ran.
  MCORE="$version" . "$HERE/gpu_setup.sh" > /dev/null || { status=1; continue; }
  cp "$OUT/machine.txt" "$OUT/machine-$version.txt"
  start=$SECONDS
  # SIGINT at the limit: pytest still prints its summary (the tests that failed so far);
  # -v names each test as it ends; with pytest-timeout carried, one test that hangs is
  # reported with its stack after TEST_TIMEOUT s instead of eating the version's limit.
  per_test=""
  python3 -c "import pytest_timeout" 2>/dev/null && per_test="--timeout=$TEST_TIMEOUT"
  timeout -s INT -k 30 "$LIMIT" python3 -m pytest -v -n "$WORKERS" $TESTS -p no:cacheprovider \
      -rfEs --durations=25 $per_test > "$OUT/tests-$version.txt" 2>&1
  rc=$?
  line="$(grep -E '[0-9]+ (passed|failed|skipped|errors?).* in [0-9.]+s' \
          "$OUT/tests-$version.txt" | tail -1)"
  [ "$rc" -eq 124 ] && line="TIMED OUT after ${LIMIT}s: ${line:-no summary}"
  echo "megatron-core $version ($(sed -n 3p "$OUT/machine-$version.txt")): rc=$rc" \
       "$((SECONDS - start)) s: ${line:-no summary line}" >> "$OUT/summary.txt"
  grep -E '^(FAILED|ERROR) ' "$OUT/tests-$version.txt" | sed 's/^/    /' >> "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || status=1
done
echo "ended: $(date -u +%Y-%m-%dT%H:%M:%SZ); peak host use: $(awk 'NF>3 {print $3}' \
     "$OUT/host_memory.txt" | sort -n | tail -1) MiB" >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
exit $status
