"""`cothink eval` / `python -m cothink.eval`: arguments and a whole quick run on a tiny model."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cothink.eval import cli, models


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cothink")
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser


def test_parser_defaults_and_options():
    args = _parser().parse_args(["eval", "all"])
    assert args.suite == "all" and not args.quick and args.out is None
    assert args.models == "smollm2,qwen35-random" and args.duration is None and args.func is cli.run
    args = _parser().parse_args(
        [
            "eval",
            "soak",
            "--quick",
            "--out",
            "x",
            "--models",
            "smollm2",
            "--duration",
            "12.5",
            "--threads",
            "1",
        ]
    )
    assert (args.suite, args.quick, args.out, args.models, args.duration, args.threads) == (
        "soak",
        True,
        "x",
        "smollm2",
        12.5,
        "1",
    )
    with pytest.raises(SystemExit):
        _parser().parse_args(["eval", "nonsense"])


def test_python_dash_m_help():
    out = subprocess.run(
        [sys.executable, "-m", "cothink.eval", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "--duration" in out.stdout and "sync-cost" in out.stdout


def test_eval_all_quick_on_a_tiny_model(tmp_path):
    folder = models.build_tiny_model(tmp_path / "tiny")
    out = tmp_path / "results"
    before = torch.get_num_threads()
    try:
        args = _parser().parse_args(
            [
                "eval",
                "all",
                "--quick",
                "--models",
                str(folder),
                "--out",
                str(out),
                "--duration",
                "1",
                "--threads",
                "1",
            ]
        )
        code = args.func(args)
    finally:
        torch.set_num_threads(before)
    assert code in (0, 1)  # 1 when a suite reports a FAIL (the report says which)
    text = (out / "report.md").read_text()
    for _, title in cli_sections():
        assert title in text
    assert "_Not run in this invocation._" not in text
    config = json.loads((out / "config.json").read_text())
    for key in ("command", "models", "dtype", "torch_threads", "versions", "cpu_model", "machine"):
        assert key in config
    assert {"torch", "transformers", "cothink"} <= set(config["versions"])
    assert config["models"][0]["name"] == "tiny"
    # the commit, CPU model and torch version every results folder records
    run = config["run"]
    git = ["git", "rev-parse", "HEAD"]
    head = subprocess.run(git, cwd=Path(__file__).parent, capture_output=True, text=True)
    assert run["commit"] == (head.stdout.strip() if head.returncode == 0 else "unknown")
    assert run["cpu"] == config["cpu_model"] != "" and run["torch"] == torch.__version__
    assert f"at commit {run['commit'][:12]}" in text
    for suite in cli.SUITE_NAMES:
        assert (out / "raw" / f"{suite}-tiny.json").exists()
        assert (out / "raw" / f"{suite}-tiny.csv").exists()
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert len(pngs) == 7 and all(p.endswith(".png") for p in pngs)
    for png in pngs:
        assert f"]({png})" in text


def cli_sections():
    from cothink.eval.report import SECTIONS

    return SECTIONS
