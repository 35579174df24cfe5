"""The offload checkpoint: save/load round trip, the manifest's checks and verification."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_ext.errors import UsageError
from megatron_ext.offload import checkpoint
from megatron_ext.offload.config import OffloadConfig
from megatron_ext.offload.engine import OffloadEngine
from megatron_ext.offload.paths import TierSpec
from megatron_ext.offload.state_format import OffloadStateError
from megatron_ext.offload.states import StateLayout
from megatron_ext.offload.subgroups import ShardParam

NUMELS = [37, 300, 5, 129]
HPARAMS = [{"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}]


def engine(tmp_path, weights, grads, subgroup_size=100, **extra):
    (tmp_path / "tier").mkdir(parents=True, exist_ok=True)
    tier = TierSpec(str(tmp_path / "tier"), read_gbps=1.0, write_gbps=1.0)
    cfg = OffloadConfig(offload_optimizer=True, offload_paths=[tier.path],
                        offload_subgroup_size=subgroup_size,
                        offload_host_cache_gb=3 * 1200 / 1e9, **extra)
    params = [ShardParam(numel=n, group=0, grad=lambda i=i: grads[i], out=weights[i],
                         init=lambda i=i: weights[i]) for i, n in enumerate(NUMELS)]
    return OffloadEngine(cfg, params, rank=0, device=torch.device("cpu"), tiers=[tier],
                         run_id="test", model_dtype=torch.float32, grad_dtype=torch.float32)


@pytest.fixture
def saved(tmp_path):
    """A checkpoint of an engine after two steps: (offload directory, its weights)."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, generator=gen) for n in NUMELS]
    grads = [torch.randn(n, generator=gen) for n in NUMELS]
    eng = engine(tmp_path, weights, grads)
    try:
        for _ in range(2):
            eng.step(HPARAMS, None, None)
        eng.save(str(tmp_path / "ckpt" / "offload"), {"world": 1})
        states = [torch.cat(eng._views(eng._acquire_sync(i), i)).clone()
                  for i in range(len(eng.subgroups))]
    finally:
        eng.close()
    return tmp_path / "ckpt" / "offload", states


def test_save_writes_the_manifest_schema(saved):
    directory, _ = saved
    manifest = json.loads((directory / "rank00000" / "manifest.json").read_text())
    assert list(manifest) == ["version", "rank", "step", "fingerprint", "subgroup_size",
                              "checksum", "state_dtypes", "param_remainders", "subgroups",
                              "world"]
    assert manifest["version"] == checkpoint.MANIFEST_VERSION and manifest["step"] == 2
    assert manifest["world"] == 1 and manifest["state_dtypes"] == ["fp32", "fp32", "fp32"]
    assert manifest["param_remainders"] is False  # fp32 weights: whole masters
    hows = {entry["how"] for entry in manifest["subgroups"]}
    assert hows <= {"written", "linked", "copied"} and "written" in hows
    assert len(hows) > 1, "cached subgroups are written, the others linked or copied"
    assert checkpoint.manifest_paths(str(directory.parent)) == [
        os.path.join("offload", "rank00000", "manifest.json")]
    assert checkpoint.manifest_problems(str(directory.parent)) == []


def test_load_restores_every_state(tmp_path, saved):
    directory, states = saved
    weights = [torch.zeros(n) for n in NUMELS]
    eng = engine(tmp_path / "other", weights, [torch.zeros(n) for n in NUMELS])
    try:
        eng.load(str(directory), {"world": 1})
        assert eng.step_count == 2 and eng.initialized
        for index in range(len(eng.subgroups)):
            got = torch.cat(eng._views(eng._acquire_sync(index), index))
            assert torch.equal(got, states[index]), f"subgroup {index} differs"
    finally:
        eng.close()


@pytest.mark.parametrize("rank, expect, fingerprint, dtypes, message", [
    (0, {"world": 1}, None, ("fp32", "fp32", "fp32"), None),
    (1, {}, None, ("fp32", "fp32", "fp32"), "no offloaded optimizer state for rank 1"),
    (0, {"world": 2}, None, ("fp32", "fp32", "fp32"), "saved with world=1, this run has 2"),
    (0, {}, "other", ("fp32", "fp32", "fp32"), "the optimizer shard layout differs"),
    (0, {}, None, ("fp32", "bf16", "bf16"), "saved as fp32/fp32/fp32 .* stores fp32/bf16/bf16"),
])
def test_open_rank_checks_the_run_against_the_manifest(saved, rank, expect, fingerprint,
                                                       dtypes, message):
    directory, _ = saved
    saved_fingerprint = json.loads(
        (directory / "rank00000" / "manifest.json").read_text())["fingerprint"]
    args = dict(fingerprint=fingerprint or saved_fingerprint,
                layout=StateLayout.from_names(*dtypes), cfg=OffloadConfig())
    if message is None:
        manifest, _ = checkpoint.open_rank(str(directory), rank, expect, **args)
        assert manifest["step"] == 2
    else:
        with pytest.raises(UsageError, match=message):
            checkpoint.open_rank(str(directory), rank, expect, **args)


def test_open_rank_refuses_a_manifest_naming_a_file_outside_its_directory(saved):
    directory, _ = saved
    path = directory / "rank00000" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["subgroups"][1]["file"] = "../../etc/passwd"
    path.write_text(json.dumps(manifest))
    with pytest.raises(UsageError) as info:
        checkpoint.open_rank(str(directory), 0, {}, fingerprint=manifest["fingerprint"],
                             layout=StateLayout.from_names("fp32", "fp32", "fp32"),
                             cfg=OffloadConfig())
    assert str(info.value).startswith(f"{path}: offload manifest: subgroup entry 1 names "
                                      "'../../etc/passwd', a file outside its directory: ")


def test_a_damaged_or_stale_state_file_is_refused_on_load(tmp_path, saved):
    directory, _ = saved
    eng = engine(tmp_path / "other", [torch.zeros(n) for n in NUMELS],
                 [torch.zeros(n) for n in NUMELS])
    try:
        manifest, read = checkpoint.open_rank(str(directory), 0, {}, fingerprint=eng.fingerprint,
                                              layout=eng.layout, cfg=eng.cfg)
        buffer = eng.cache.allocate()
        read(eng.store, 1, buffer)  # intact
        name = directory / "rank00000" / "sg00001.state"
        data = bytearray(name.read_bytes())
        os.unlink(name)  # a hard link to a tier file: replace it, do not write through it
        data[4096 + 7] ^= 1
        name.write_bytes(bytes(data))
        with pytest.raises(OffloadStateError, match="the checkpoint is damaged; resume from an "
                                                    "earlier one"):
            read(eng.store, 1, buffer)
        manifest["step"] = 3
        with pytest.raises(OffloadStateError, match="state of step 2, the manifest says 3"):
            read(eng.store, 0, buffer)
    finally:
        eng.close()


GOOD = {"step": 3, "rank": 0, "subgroups": [{"subgroup": 0, "elements": 4, "file": "sg0.state"}]}


@pytest.mark.parametrize("data, problem", [
    (json.dumps(GOOD).encode(), None),
    (b"{", "not valid JSON"),
    (b"7", "not a JSON object"),
    (json.dumps({**GOOD, "rank": "0"}).encode(), "'rank' missing or not an integer"),
    (json.dumps({**GOOD, "subgroups": [{"subgroup": 0, "elements": "4", "file": "x"}]}).encode(),
     "subgroup entry 0 is malformed"),
    (json.dumps({**GOOD, "subgroups": [{"subgroup": 0, "elements": 4, "file": "/x"}]}).encode(),
     "subgroup entry 0 names '/x', a file outside its directory"),
])
def test_check_manifest(data, problem):
    found = checkpoint.check_manifest(data)
    assert (found is None) if problem is None else (problem in found), found


def test_manifest_problems_names_missing_and_extra_files(saved):
    directory, _ = saved
    root, rank_dir = str(directory.parent), directory / "rank00000"
    name = os.path.join("offload", "rank00000", "manifest.json")
    (directory.parent / "model" / "rank00000").mkdir(parents=True)
    (directory.parent / "model" / "rank00000" / "manifest.json").write_text("{")  # not ours
    assert checkpoint.manifest_problems(root) == []
    os.rename(rank_dir / "sg00002.state", rank_dir / "sg00099.state")
    assert checkpoint.manifest_problems(root) == [
        (name, "offload manifest: lists sg00002.state, which is missing")]
    os.link(rank_dir / "sg00099.state", rank_dir / "sg00002.state")
    assert checkpoint.manifest_problems(root) == [
        (name, "offload manifest: lists 5 subgroups, the directory holds 6")]
    (rank_dir / "manifest.json").write_text("{")
    assert checkpoint.manifest_problems(root) == [(name, "offload manifest: not valid JSON")]
