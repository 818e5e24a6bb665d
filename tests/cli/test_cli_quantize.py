"""`--quantize int8` / `int4` reach the engine from the command line; unknown modes are refused."""

from __future__ import annotations

import pytest

from cothink import cli


def test_generate_int8(capsys):
    assert cli.main(["generate", "--prompt", "What is the capital of France?", "--max-tokens", "8",
                     "--dtype", "bfloat16", "--quantize", "int8"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "int8 weights" in captured.err


def test_generate_int4(capsys):
    assert cli.main(["generate", "--prompt", "What is the capital of France?", "--max-tokens", "8",
                     "--quantize", "int4"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "int4 weights" in captured.err


@pytest.mark.parametrize("command", ["generate", "serve", "demo", "eval"])
def test_quantize_choices(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--quantize", "int3"] + (["--prompt", "x"] if command == "generate" else []))
    assert "int8" in capsys.readouterr().err


def test_the_parser_names_the_engine_modes():
    from cothink.models.quantize import QUANTIZE_MODES

    assert cli.QUANTIZE_MODES == QUANTIZE_MODES
