# Sourced by the bench/gpu_*.sh drivers on the lent GPU machine: installs the carried wheels
# (.whl/) into /tmp/mext-site, puts them on PYTHONPATH, and writes $OUT/machine.txt.
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Once per set of wheels (drivers that call other drivers source this again).
STAMP="$(ls -l .whl/*.whl | md5sum | cut -c1-32)"
if [ "$(cat /tmp/mext-site/.wheels 2>/dev/null)" != "$STAMP" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/mext-site .whl/*.whl || { echo "wheel install failed"; exit 1; }
  echo "$STAMP" > /tmp/mext-site/.wheels
fi
export PYTHONPATH="/tmp/mext-site${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)" 2>/dev/null
  nproc; free -g | head -2; df -h / /dev/shm | tail -2
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
