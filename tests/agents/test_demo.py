"""The demo (`cothink demo`): a thinker, a narrator and a user interjection on the embedded model."""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys


from cothink.agents import demo


def test_demo_help():
    out = subprocess.run(
        [sys.executable, "-m", "cothink.agents.demo", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0
    for flag in ("--model", "--max-tokens", "--dtype", "--seed", "--no-live", "--trace"):
        assert flag in out.stdout


def test_add_parser_registers_demo():
    parser = argparse.ArgumentParser(prog="cothink")
    demo.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["demo", "--max-tokens", "8", "--no-live"])
    assert args.func is demo.run and args.max_tokens == 8 and args.no_live and args.model == "smollm2"


def _row(text: str, name: str) -> list[int]:
    line = next(ln for ln in text.splitlines() if re.match(rf"^\W*{name}\b", ln.strip("│┃ ")) and "│" in ln)
    return [int(x) for x in re.findall(r"\b\d+\b", line)]


def test_demo_runs_end_to_end(tmp_path):
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=200, force_terminal=False, color_system=None)
    trace = tmp_path / "trace.json"
    args = demo.configure_parser(argparse.ArgumentParser()).parse_args(
        ["--max-tokens", "24", "--narrate-every", "8", "--no-live", "--trace", str(trace)]
    )
    result = demo.run_with_result(args, console)
    out = buf.getvalue()
    engine = result.engine

    # both streams, the interjection, the summary
    assert "[thinker]" in out and "[narrator]" in out and "[probe]" in out
    assert f"[user] {demo.INTERJECTION}" in out
    assert "forward passes" in out and "text passing" in out

    # the interjection landed in the shared context and the thinker kept its block (no restart)
    assert result.interjected_at is not None and 0 < result.interjected_at <= 24
    assert demo.INTERJECTION in engine.tokenizer.decode(result.ctx_tokens)
    assert result.thinker_generated > 0 and len(result.narrations) >= 1
    assert all(n.text for n in result.narrations)

    # the summary's numbers are the engine's
    assert result.steps == engine.steps > 0
    assert f"engine: {engine.steps} forward passes" in out
    for name in ("user", "thinker", "narrator"):
        s = engine.stats[name]
        assert s.forward_passes > 0 and s.tokens_written > 0 and s.tokens_read > 0
        generated = {"user": 0, "thinker": result.thinker_generated, "narrator": result.narrator_generated}[
            name
        ]
        assert _row(out, name) == [s.works, s.forward_passes, generated, s.tokens_written, s.tokens_read]
    # the thinker's block holds exactly what it wrote: its prompt, cue and generated tokens
    thinker = engine.stats["thinker"]
    assert thinker.tokens_written == result.thinker_block_len
    # text passing: each sync re-reads ctx + thinker, computed from real block lengths
    assert result.syncs and all(s.text_passing_reencode > s.thinker_len > 0 for s in result.syncs)
    assert result.text_passing_total > 0 and str(result.text_passing_total) in out

    # the trace and its picture
    assert trace.exists() and trace.with_suffix(".png").exists()
