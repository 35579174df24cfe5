"""Fixtures of the Slurm tests: one real Slurm cluster on localhost per test session."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.slurm.cluster import SlurmCluster, missing_programs


@pytest.fixture(scope="session")
def slurm_cluster():
    """munged + slurmctld + slurmd on this machine (see cluster.py), stopped at the end."""
    missing = missing_programs()
    if missing:
        pytest.skip(f"Slurm is not installed (missing {', '.join(missing)}); "
                    "install it with: bash tests/slurm/install_slurm.sh")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster runs its daemons as root (SlurmUser=root); "
                    "run the Slurm tests as root")
    # Not under pytest's tmp_path: munged wants o+x on every folder above its socket, and
    # pytest's are private.
    prefix = Path(tempfile.mkdtemp(prefix="megatron_ext-slurm-"))
    # KillWait 60 s (Slurm's default is 30): time for a checkpoint on SIGTERM on a busy
    # machine before Slurm's SIGKILL.
    cluster = SlurmCluster(prefix, kill_wait_s=60)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(prefix, ignore_errors=True)
