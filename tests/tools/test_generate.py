"""tools/generate.py: greedy decoding reproduces what a tiny model memorized; bad input."""

from __future__ import annotations

import generate
import model_testlib as lib
import pytest
from model_testlib import assert_ok, assert_usage_error, call_tool


def test_greedy_continues_the_memorized_sentence(finetuned_run):
    import sentencepiece

    prompt, count = "alpha beta gamma", 12
    run = call_tool(generate, "--load", finetuned_run.ckpt_out, "--prompt", prompt,
                    "--max-new-tokens", count, "--greedy", "--device", "cpu")
    assert_ok(run)
    # The next `count` tokens of the training text after the prompt, exactly.
    sp = sentencepiece.SentencePieceProcessor(model_file=finetuned_run.tokenizer)
    text_ids, prompt_ids = sp.encode(lib.SENTENCE * 2), sp.encode(prompt)
    assert text_ids[:len(prompt_ids)] == prompt_ids
    expected = sp.decode(text_ids[len(prompt_ids):len(prompt_ids) + count])
    assert expected.startswith(" delta epsilon zeta")
    assert run.stdout == expected + "\n"


def test_sampling_is_seeded(finetuned_run):
    """Same seed, same text; sampling at a high temperature reaches other tokens."""
    args = ["--load", finetuned_run.ckpt_out, "--prompt", "alpha", "--max-new-tokens", "8",
            "--temperature", "5.0", "--top-k", "50", "--top-p", "0.99", "--device", "cpu"]
    first = call_tool(generate, *args, "--seed", "7")
    again = call_tool(generate, *args, "--seed", "7")
    other = [call_tool(generate, *args, "--seed", str(s)).stdout for s in (1, 2)]
    for run in (first, again):
        assert_ok(run)
    assert first.stdout == again.stdout
    assert any(text != first.stdout for text in other), other


@pytest.mark.parametrize("argv, expected", [
    (["--load", "/nonexistent/ckpt", "--prompt", "x"], "--load /nonexistent/ckpt"),
    (["--load", ".", "--prompt", "x", "--greedy", "--top-k", "3"], "--greedy"),
    (["--load", ".", "--prompt", "x", "--top-p", "1.5"], "--top-p"),
])
def test_bad_input_is_one_line(argv, expected):
    assert_usage_error(call_tool(generate, *argv), expected)


@pytest.mark.parametrize("prompt, noted", [
    ("import os\n\ndef ", True), ("x =\t", True), ("def main():\n", False), ("def", False),
    ("", False)])
def test_a_prompt_ending_in_a_space_is_noted(prompt, noted):
    # The quickstart's old prompt ended in "def ": a lone space piece, then "1" and blank lines.
    note = generate.trailing_space_note(prompt)
    assert (note is not None) == noted
    if noted:
        assert "ends in whitespace" in note
