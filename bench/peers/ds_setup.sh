#!/usr/bin/env bash
# The DeepSpeed bundle's set-up on the GPU machine, for the bench/gpu/gpu_*.sh drivers (.peers
# carried; run from the repository root):
#   full     the bundle's whole setup_on_gpu.sh: install, then build and load the async_io
#            (ZeRO-Infinity NVMe) and cpu_adam ops
#   cpu      its install and the cpu_adam op only (ZeRO-Offload, ZenFlow, --offload cpu:
#            ~1 min less than full)
#   install  its install only (no op built)
# Usage: bash bench/peers/ds_setup.sh full|cpu|install > log 2>&1
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1  # the repository root: .peers/ is its
BUNDLE=.peers/deepspeed
case "${1:-}" in
  full) exec bash "$BUNDLE/setup_on_gpu.sh" ;;
  install) exec bash "$BUNDLE/setup_on_gpu.sh" --no-build ;;
  cpu)
    bash "$BUNDLE/setup_on_gpu.sh" --no-build || exit 1
    . "$BUNDLE/env.sh"
    exec python3 -c "import time; t = time.time(); \
from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); \
print('[dsbundle] cpu_adam ok (%.0f s)' % (time.time() - t))" ;;
  *) echo "usage: bash bench/peers/ds_setup.sh full|cpu|install"; exit 2 ;;
esac
