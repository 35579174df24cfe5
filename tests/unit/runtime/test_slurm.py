"""Process layout from Slurm's environment (plain srun)."""

import pytest

from megatron_ext.runtime.slurm import expand_nodelist, tasks_per_node, torch_env_from_slurm


@pytest.mark.parametrize("nodelist,hosts", [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("a[8-10],b5", ["a8", "a9", "a10", "b5"]),
    ("x[1,3]-ib", ["x1-ib", "x3-ib"]),
    ("login1,login2", ["login1", "login2"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_env_from_srun():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "12345"}
    got = torch_env_from_slurm(env)
    assert got["RANK"] == "3" and got["WORLD_SIZE"] == "8" and got["LOCAL_RANK"] == "1"
    assert got["MASTER_ADDR"] == "gpu07"
    assert got["MASTER_PORT"] == str(20000 + 12345 % 20000)


def test_torchrun_env_wins_and_no_slurm_means_none():
    assert torch_env_from_slurm({"RANK": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None
    assert torch_env_from_slurm({}) is None


@pytest.mark.parametrize("spec,counts", [
    ("4", [4]), ("4(x2),3", [4, 4, 3]), ("2,1(x3)", [2, 1, 1, 1]), ("", []), ("x", []),
])
def test_tasks_per_node(spec, counts):
    assert tasks_per_node(spec) == counts


def test_local_world_size_from_the_step_layout():
    """Plain srun sets no LOCAL_WORLD_SIZE: it comes from the step's tasks on this node (the
    ZenFlow CPU rule reads it), the step's layout before the job's."""
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODEID": "1",
           "SLURM_STEP_TASKS_PER_NODE": "4,3", "SLURM_TASKS_PER_NODE": "8(x2)"}
    assert torch_env_from_slurm(env)["LOCAL_WORLD_SIZE"] == "3"
    del env["SLURM_STEP_TASKS_PER_NODE"]
    assert torch_env_from_slurm(env)["LOCAL_WORLD_SIZE"] == "8"
    assert "LOCAL_WORLD_SIZE" not in torch_env_from_slurm({**env, "SLURM_NODEID": "2"})
    assert "LOCAL_WORLD_SIZE" not in torch_env_from_slurm({**env, "LOCAL_WORLD_SIZE": "2"})
