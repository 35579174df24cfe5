"""The output sections' rules: --save-interval without --save (Megatron-LM's meaning)."""

from megatron_ext.config import parse_config

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "4",
         "--lr", "1e-3", "--train-iters", "8", "--mock-data", "--vocab-size", "100"]


def test_save_interval_without_save_is_accepted_with_a_note():
    """Megatron-LM saves nothing then (its launch scripts with the --save line dropped run):
    accepted, and the start-up's line says nothing will be saved."""
    ckpt = parse_config([*FLAGS, "--save-interval", "5"]).checkpoint
    assert ckpt.save is None and ckpt.save_interval == 5
    assert ckpt.save_note() == ("--save-interval 5 without --save: no checkpoint will be "
                                "saved (give --save DIR to save them)")


def test_no_note_with_save_or_without_an_interval(tmp_path):
    assert parse_config([*FLAGS, "--save-interval", "5", "--save",
                         str(tmp_path / "ckpt")]).checkpoint.save_note() is None
    assert parse_config(FLAGS).checkpoint.save_note() is None
