#!/usr/bin/env bash
# Runs a command with DeepSpeed's bundle on a machine WITHOUT a GPU (DeepSpeed's CPU
# accelerator), for bench/peers/ds_finetune.py's CPU comparison of DeepSpeed's ZenFlow and Adam:
#   PYTHON=.venv/bin/python bash bench/peers/ds_cpu_env.sh .venv/bin/python bench/gpu/zenflow_finetune.py \
#       --part deepspeed --tiny ...
# The bundle's wheel goes to $DS_CPU_SITE (default /tmp/ds-cpu-site; nothing is installed
# into the Python environment). Three modules DeepSpeed imports but this comparison never
# uses are stand-ins there when the environment lacks them: einops and msgpack (imported
# by its profiler and pipeline modules) and py-cpuinfo (read for the CPU's vendor and SIMD
# flags: the stand-in reads /proc/cpuinfo). The first ZenFlow run JIT-builds the cpu_adam
# op with the system's g++ and ninja (a few minutes on 2 cores).
set -euo pipefail
BUNDLE="${DS_BUNDLE:-/work/shared/peers/deepspeed}"
SITE="${DS_CPU_SITE:-/tmp/ds-cpu-site}"
PY="${PYTHON:-python3}"  # the interpreter the command runs (its modules are checked)
if [ ! -d "$SITE/deepspeed" ]; then
  "$PY" -m pip install -q --no-index --no-deps --target "$SITE" \
      "$BUNDLE"/whl/deepspeed-*.whl "$BUNDLE"/whl/hjson-*.whl
fi
STUBS="$SITE/_stubs"
mkdir -p "$STUBS"
for mod in einops msgpack; do
  if ! "$PY" -c "import $mod" 2>/dev/null; then
    mkdir -p "$STUBS/$mod"
    echo "# stand-in: imported by DeepSpeed, not used by bench/peers/ds_finetune.py" \
        > "$STUBS/$mod/__init__.py"
  fi
done
if ! "$PY" -c "import cpuinfo" 2>/dev/null; then
  mkdir -p "$STUBS/cpuinfo"
  cat > "$STUBS/cpuinfo/__init__.py" <<'EOF'
"""Stand-in for py-cpuinfo: the vendor and flags of /proc/cpuinfo."""
import platform


def get_cpu_info():
    info = {"arch": "X86_64" if platform.machine() == "x86_64" else platform.machine().upper(),
            "flags": []}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "vendor_id":
                info["vendor_id_raw"] = value.strip()
            elif key.strip() == "flags":
                info["flags"] = value.split()
                break
    return info
EOF
fi
export PYTHONPATH="$SITE:$STUBS:$(cd "$(dirname "$0")/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
export DS_ACCELERATOR=cpu
exec "$@"
