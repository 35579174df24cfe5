"""Reading the process layout from Slurm's environment (plain ``srun``, no torchrun)."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Dict, List, Mapping, Optional


def expand_nodelist(nodelist: str) -> List[str]:
    """Expands a Slurm node list such as ``gpu[01-03,07],login1`` into host names.

    Pure Python (no ``scontrol`` needed), for the bracket forms Slurm prints:
    comma-separated hosts, each with at most one bracket group of numbers and ranges,
    zero padding kept.
    """
    hosts: List[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", nodelist):
        head, ranges, tail = match.group(1), match.group(2), match.group(3)
        if not head and not ranges:
            continue
        if ranges is None:
            hosts.append(head + tail)
            continue
        for part in ranges.split(","):
            if "-" in part:
                lo, hi = part.split("-", 1)
                width = len(lo)
                for n in range(int(lo), int(hi) + 1):
                    hosts.append(f"{head}{n:0{width}d}{tail}")
            else:
                hosts.append(f"{head}{part}{tail}")
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a node list, through ``scontrol`` when available."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                                 capture_output=True, text=True, timeout=30).stdout.split()
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError):
            pass
    return expand_nodelist(nodelist)[0]


def tasks_per_node(spec: str) -> List[int]:
    """Slurm's per-node task counts (``SLURM_STEP_TASKS_PER_NODE``) as a list.

    ``"4(x2),3"`` -> ``[4, 4, 3]``; an unreadable spec gives ``[]``.
    """
    counts: List[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            return []
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def torch_env_from_slurm(env: Mapping[str, str]) -> Optional[Dict[str, str]]:
    """Returns the torch.distributed variables for a task started by plain ``srun``.

    None when the process was not started by srun, or when torchrun already set them.
    MASTER_PORT defaults to a port derived from the job id so that two jobs sharing a
    node do not collide. LOCAL_WORLD_SIZE (the tasks of this step on this node, as torchrun
    sets it) comes from SLURM_STEP_TASKS_PER_NODE and SLURM_NODEID when Slurm gives them.
    """
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    job_id = int(env.get("SLURM_JOB_ID", "0") or 0)
    out = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env["SLURM_NTASKS"],
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodelist),
        "MASTER_PORT": env.get("MASTER_PORT") or str(20000 + job_id % 20000),
    }
    counts = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or
                            env.get("SLURM_TASKS_PER_NODE") or "")
    node = env.get("SLURM_NODEID", "")
    if node.isdigit() and int(node) < len(counts) and "LOCAL_WORLD_SIZE" not in env:
        out["LOCAL_WORLD_SIZE"] = str(counts[int(node)])
    return out
