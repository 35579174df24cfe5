#!/usr/bin/env bash
# Installs the Debian packages that tests/slurm needs (a real Slurm cluster on localhost):
#   bash tests/slurm/install_slurm.sh
# Idempotent and quick when everything is there already (no apt-get call at all then).
# Needs root (or sudo) and a Debian/Ubuntu apt; elsewhere it says so and exits 1. Nothing
# is started: tests/slurm/cluster.py runs munged, slurmctld and slurmd itself.
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge)
BINARIES=(slurmctld slurmd sbatch scontrol srun scancel munged mungekey)

slurm_version() { dpkg-query -W -f '${Version}' slurm-client 2>/dev/null || echo "?"; }

missing=()
for bin in "${BINARIES[@]}"; do
  command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || missing+=("$bin")
done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "install_slurm: already installed (slurm $(slurm_version))"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_slurm: missing ${missing[*]} and no apt-get here; install ${PACKAGES[*]}" >&2
  exit 1
fi
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "install_slurm: needs root or sudo" >&2; exit 1; }
  SUDO=(sudo)
fi

echo "install_slurm: missing ${missing[*]}; installing ${PACKAGES[*]}"
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
echo "install_slurm: installed (slurm $(slurm_version))"
