"""The pure checks behind checkpoint integrity, the model-settings check and empty splits."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from megatron_ext.checkpoint import checkpoint_args, integrity
from megatron_ext.config.model import ModelConfig
from megatron_ext.data.datasets import check_split_sizes
from megatron_ext.errors import UsageError
from megatron_ext.offload.checkpoint import check_manifest

EXPECTED = {"a": {"size": 3, "xxh3": "aa"}, "b": {"size": 5, "xxh3": "bb"}}


@pytest.mark.parametrize("actual, problem", [
    ({"a": [3, "aa"], "b": [5, "bb"]}, None),
    ({"a": [3, "aa"]}, ("b", "missing")),
    ({"a": [3, "aa"], "b": [None, "No such file or directory"]}, ("b", "missing")),
    ({"a": [2, "aa"], "b": [5, "bb"]}, ("a", "2 bytes, 3 were written")),
    ({"a": [3, "ab"], "b": [5, "bb"]}, ("a", "checksum mismatch")),
    ({"a": [3, "aa"], "b": [None, "Permission denied"]}, ("b", "Permission denied")),
])
def test_compare(actual, problem):
    found = integrity.compare(EXPECTED, actual)
    if problem is None:
        assert found == []
    else:
        assert len(found) == 1 and found[0][0] == problem[0] and problem[1] in found[0][1]


GOOD = {"step": 3, "rank": 0, "subgroups": [{"subgroup": 0, "elements": 4, "file": "sg0.state"}]}


@pytest.mark.parametrize("data, problem", [
    (json.dumps(GOOD).encode(), None),
    (b"", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[1, 2]", "not a JSON object"),
    (json.dumps({**GOOD, "step": None}).encode(), "'step' missing"),
    (json.dumps({**GOOD, "step": True}).encode(), "'step' missing"),
    (json.dumps({**GOOD, "subgroups": {}}).encode(), "'subgroups' missing"),
    (json.dumps({**GOOD, "subgroups": [{"subgroup": 1, "elements": 4, "file": "x"}]}).encode(),
     "subgroup entry 0 is malformed"),
    (json.dumps({**GOOD, "subgroups": [{"subgroup": 0, "elements": 4, "file": "../x"}]}).encode(),
     "subgroup entry 0 names '../x', a file outside its directory"),
    (json.dumps({**GOOD, "subgroups": [{"subgroup": 0, "elements": 4, "file": ".."}]}).encode(),
     "subgroup entry 0 names '..', a file outside its directory"),
])
def test_check_offload_manifest(data, problem):
    found = check_manifest(data)
    assert (found is None) if problem is None else (problem in found), found


@pytest.mark.parametrize("name, inside", [
    ("common.pt", True), ("offload/rank00000/sg00001.state", True), ("../../etc/passwd", False),
    ("/etc/passwd", False), ("a/../../b", False), ("a/../b", False), ("..", False), ("", False),
    ("./a", False),
])
def test_a_manifest_names_files_inside_its_checkpoint(name, inside):
    assert integrity.inside(name) is inside


def test_settings_from_our_config_and_from_megatron_args():
    ours = {"config": {"model": {"num_layers": 2, "hidden_size": 64, "disable_bias_linear": True}},
            "padded_vocab_size": 128}
    assert checkpoint_args.saved_settings(ours) == {"num_layers": 2, "hidden_size": 64,
                                                    "disable_bias_linear": True,
                                                    "padded_vocab_size": 128}
    megatron = {"args": argparse.Namespace(num_layers=4, hidden_size=256, add_bias_linear=False,
                                           padded_vocab_size=512, swiglu=True)}
    saved = checkpoint_args.saved_settings(megatron)
    assert saved["num_layers"] == 4 and saved["disable_bias_linear"] is True
    assert saved["swiglu"] is True and saved["padded_vocab_size"] == 512
    assert checkpoint_args.saved_settings({}) is None


def test_differences_name_each_setting():
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                        max_position_embeddings=32)
    saved = {"num_layers": 3, "hidden_size": 64, "hidden_dropout": 0.0, "num_query_groups": 8,
             "padded_vocab_size": 256}
    diff = checkpoint_args.differences(saved, model, padded_vocab=128)
    # dropout is no architecture; the group count is unused without GQA.
    assert diff == ["--num-layers 3 (this run: 2)",
                    "padded vocabulary 256 (this run: 128; --vocab-size / --tokenizer-model, "
                    "--make-vocab-size-divisible-by)"]
    new, taken = checkpoint_args.apply_settings({"config": {"model": saved}}, model, "ckpt")
    assert new.num_layers == 3 and new.hidden_dropout == 0.0 and "num_layers=3" in taken


def test_differences_say_not_given_and_on_off_never_none():
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                        max_position_embeddings=32, kv_channels=16)
    saved = {"kv_channels": None, "swiglu": True}
    diff = checkpoint_args.differences(saved, model, padded_vocab=None)
    assert diff == ["--kv-channels not given (this run: 16)", "--swiglu on (this run: off)"]


@pytest.mark.parametrize("split, n, problem", [
    ("969,30,1", 120, "the test split of p is empty"),
    ("969,30,1", 300, "the test split of p is empty"),
    ("969,30,1", 1000, None),
    ("969,30,0", 120, None),
    ("98,2", 120, None),
    ("1,0,999", 120, "the train split of p is empty"),
])
def test_empty_split(split, n, problem):
    lengths = [("p", np.full(n, 10, dtype=np.int32))]
    if problem is None:
        check_split_sizes(split, lengths)
    else:
        with pytest.raises(UsageError, match=problem):
            check_split_sizes(split, lengths)


def test_tools_take_the_runs_tokenizer_and_its_files(tmp_path):
    """tools/generate.py and evaluate.py: every tokenizer field is the run's unless given;
    another type drops the run's files."""
    from megatron_ext.checkpoint import standalone

    vocab, merges, spm = (tmp_path / n for n in ("vocab.json", "merges.txt", "spm.model"))
    for f in (vocab, merges, spm):
        f.write_text("x")
    data = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": str(vocab),
            "merge_file": str(merges), "tokenizer_model": None, "vocab_extra_ids": 0}
    common = {"config": {"model": {}, "data": data}}
    got = standalone.tokenizer_settings(common)
    assert got["tokenizer_type"] == "GPT2BPETokenizer"
    assert (got["vocab_file"], got["merge_file"]) == (str(vocab), str(merges))
    other = standalone.tokenizer_settings(common, {"tokenizer_type": "SentencePieceTokenizer",
                                                   "tokenizer_model": str(spm),
                                                   "vocab_file": None})
    assert other["tokenizer_model"] == str(spm)
    assert other["vocab_file"] is None and other["merge_file"] is None
    vocab.unlink()
    with pytest.raises(UsageError, match=f"the run's --vocab-file {vocab}: not found"):
        standalone.tokenizer_settings(common)
    with pytest.raises(UsageError, match="records no tokenizer"):
        standalone.tokenizer_settings({"config": {"model": {}, "data": {}}})
    assert standalone.tokenizer_settings({"config": {"model": {}, "data": {"vocab_size": 99}}}) == {
        "tokenizer_type": "NullTokenizer", "vocab_size": 99, "tokenizer_model": None,
        "vocab_file": None, "merge_file": None, "tiktoken_pattern": None}


def test_tools_read_megatron_lms_args_with_torch_dtypes():
    """Megatron-LM's validate_args stores the state dtypes as torch dtypes: a checkpoint it
    wrote must still give the tools a valid run config (generate, evaluate, HF export)."""
    import torch

    from megatron_ext.checkpoint import standalone

    args = argparse.Namespace(num_layers=4, hidden_size=256, num_attention_heads=8,
                              seq_length=256, max_position_embeddings=256,
                              add_bias_linear=False, swiglu=True, bf16=True,
                              main_params_dtype=torch.float32, exp_avg_dtype=torch.bfloat16,
                              exp_avg_sq_dtype=torch.float16, params_dtype=torch.bfloat16,
                              use_precision_aware_optimizer=True,
                              tokenizer_type="NullTokenizer", vocab_size=8191)
    sections = standalone.saved_sections({"args": args})
    assert sections["optimizer"]["main_params_dtype"] == "fp32"
    assert sections["optimizer"]["exp_avg_dtype"] == "bf16"
    assert sections["optimizer"]["exp_avg_sq_dtype"] == "fp16"
    cfg = standalone.run_config({"args": args})
    assert cfg.model.num_layers == 4 and cfg.model.disable_bias_linear is True
    # This project's own run with bf16 moments in the offload engine: the tools' plain
    # optimizer must not inherit settings that only validate with --offload-optimizer.
    ours = {"config": {"model": dict(num_layers=2, hidden_size=64, num_attention_heads=4,
                                     seq_length=64, max_position_embeddings=64),
                       "optimizer": dict(use_precision_aware_optimizer=True,
                                         exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")}}
    assert standalone.run_config(ours).optimizer.exp_avg_dtype == "fp32"


@pytest.mark.parametrize("zipfile", [False, True])
def test_random_bytes_in_a_pickle_are_always_a_damaged_checkpoint(zipfile):
    """Random bytes over a pickled object fail the unpickler in many ways (IndexError, KeyError,
    struct.error, ...): every one is the same one-line "damaged" refusal. CI once met an
    IndexError that slipped through; 200 seeded patterns cover the usual ones."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save({"random_rng_state": (3, tuple(range(625)), None), "iteration": 4}, buf,
               _use_new_zipfile_serialization=zipfile)
    clean = buf.getvalue()
    rng = np.random.default_rng(0)
    kinds = set()
    for seed in range(200):
        damaged = bytearray(clean)
        start = int(rng.integers(0, len(clean) - 16))
        length = int(rng.integers(1, min(256, len(clean) - start)))
        damaged[start:start + length] = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
        try:
            integrity._safe_torch_load(io.BytesIO(bytes(damaged)), f"pattern {seed}", "state")
        except UsageError as err:
            text = str(err)
            assert "\n" not in text and text.startswith(f"pattern {seed}: the state ")
            assert "cannot be read" in text or "outside the allowed types" in text
            kinds.add(text.split("(", 1)[1].split(":", 1)[0])
        # A pattern that still unpickles (damage inside a number) is not an error here:
        # the manifest's checksums catch that when the checkpoint has one.
    assert len(kinds) >= 2, kinds
