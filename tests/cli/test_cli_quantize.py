"""`--quantize int8` reaches the engine from the command line; unknown modes are refused."""

from __future__ import annotations

import pytest

from cothink import cli


def test_generate_int8(capsys):
    assert cli.main(["generate", "--prompt", "What is the capital of France?", "--max-tokens", "8",
                     "--dtype", "bfloat16", "--quantize", "int8"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "int8 weights" in captured.err


@pytest.mark.parametrize("command", ["generate", "serve", "demo", "eval"])
def test_quantize_choices(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--quantize", "int4"] + (["--prompt", "x"] if command == "generate" else []))
    assert "int8" in capsys.readouterr().err
