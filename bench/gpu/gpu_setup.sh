# Sourced by the bench/gpu/gpu_*.sh drivers on the lent GPU machine: installs the carried wheels
# (.whl/) into /tmp/mext-site (megatron-core's, as MCORE chooses, beside it), puts them on
# PYTHONPATH, and writes $OUT/machine.txt.
# The drivers' paths (.whl/, bench/, tests/) are the repository root's: go there, OUT made
# absolute first so that a relative OUT still means the caller's folder.
MEXT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$MEXT_ROOT" || exit 1
export PYTHONUNBUFFERED=1
# MCORE picks the megatron-core of the run among the carried wheels (0.16.1 by default, or
# 0.19.2; .whl/ holds megatron_core-<version>-cp312-*.whl of each): the other wheels go to
# /tmp/mext-site, each megatron-core to a folder of its own, so that one command can run a row
# on each version in turn (MCORE=0.19.2 . bench/gpu/gpu_setup.sh again switches PYTHONPATH).
MCORE="${MCORE:-0.16.1}"
MCORE_WHEEL="$(ls .whl/megatron_core-"$MCORE"-*.whl 2>/dev/null | head -1)"
[ -n "$MCORE_WHEEL" ] || { echo "no .whl/megatron_core-$MCORE-*.whl (MCORE=$MCORE)"; exit 1; }
# Once per set of wheels (drivers that call other drivers source this again).
OTHERS=($(ls .whl/*.whl | grep -v '/megatron_core-'))
STAMP="$(ls -l "${OTHERS[@]}" | md5sum | cut -c1-32)"
if [ "$(cat /tmp/mext-site/.wheels 2>/dev/null)" != "$STAMP" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/mext-site "${OTHERS[@]}" || { echo "wheel install failed"; exit 1; }
  echo "$STAMP" > /tmp/mext-site/.wheels
fi
MCORE_SITE="/tmp/mext-mcore-$MCORE"
if [ ! -f "$MCORE_SITE/.done" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$MCORE_SITE" "$MCORE_WHEEL" || { echo "megatron-core $MCORE install failed"; exit 1; }
  touch "$MCORE_SITE/.done"
fi
# This megatron-core first; any other one a previous source put on the path, out.
KEPT="$(printf '%s' "${PYTHONPATH:-}" | tr ':' '\n' | grep -v -E '^/tmp/mext-(site|mcore-.*)$' \
        | paste -sd: -)"
export PYTHONPATH="$MCORE_SITE:/tmp/mext-site${KEPT:+:$KEPT}"
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)" 2>/dev/null
  nproc; free -g | head -2; df -h / /dev/shm | tail -2
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
