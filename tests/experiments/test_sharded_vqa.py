"""ShardedVQA on a tiny multimodal model with random weights (the runs are real; their answers say nothing
about any trained model): the conditions' exact relations (a swap at 0 and a restart are the clean run;
a swap at k keeps the tampered run's first k thoughts), the cost of restarting, answer parsing, and a
--quick run through the CLI."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from cothink.errors import InvalidParameterError
from cothink.experiments import harness
from cothink.experiments import sharded_vqa as sv
from cothink.experiments.sharded_vqa_data import make_item
from support import tiny_folder, tiny_vision_folder


def test_parse_answer():
    assert sv.parse_answer(" There are 3 red shapes, not 4", "count-colour") == "3"
    assert sv.parse_answer("It is Blue.", "colour") == "blue"
    assert sv.parse_answer("bluest", "colour") is None
    assert sv.parse_answer("none", "digit") is None


def _config(**kw):
    base = dict(experiment=sv.NAME, model="m", data="seed:0", count=1, px=64, steps=[4],
                conditions=list(sv.CONDITIONS), answer_tokens=3, max_tokens=6, seed=0)
    return sv.VQAConfig(**{**base, **kw})


def test_conditions_relate_exactly():
    handle = harness.load_model(str(tiny_vision_folder("qwen35_vl")))
    item = make_item(0, 1, px=64)
    config = _config()

    def case(condition, k=None):
        return asyncio.run(sv.run_item(handle, item, condition, k, config))

    clean, never = case("clean"), case("never")
    swap0, swap4, restart4 = case("swap", 0), case("swap", 4), case("restart", 4)
    # a swap before any thought, and a restart from scratch, think and answer as the clean run
    assert (swap0.thoughts, swap0.said) == (clean.thoughts, clean.said)
    assert (restart4.thoughts, restart4.said) == (clean.thoughts, clean.said)
    # a swap at 4 keeps the 4 tokens written over the tampered picture, then reads the corrected one
    tok = handle.tokenizer
    never_ids, swap_ids = tok.encode(never.thoughts), tok.encode(swap4.thoughts)
    assert swap_ids[:4] == never_ids[:4] and len(swap_ids) > 4
    assert swap4.thinking_tokens == restart4.thinking_tokens == 4 + config.max_tokens
    assert clean.thinking_tokens == never.thinking_tokens == config.max_tokens
    # the restart encodes the question again: it costs more than the swap
    assert restart4.tokens_encoded > swap4.tokens_encoded > clean.tokens_encoded
    for row in (clean, never, swap4):
        assert row.correct == (row.parsed == item.answer) and row.answer != row.tampered_answer


def test_a_text_model_is_refused(tmp_path):
    with pytest.raises(InvalidParameterError, match="needs a vision model"):
        sv.run_experiment(_config(model=str(tiny_folder("llama"))), sv.sharded_vqa(0, 1, px=64), tmp_path)
    assert not (tmp_path / "results.json").exists()


def test_quick_run(tmp_path):
    out = tmp_path / "out"
    parser = argparse.ArgumentParser()
    harness.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["experiment", "sharded-vqa", "--model", str(tiny_vision_folder("qwen3_vl")),
                              "--quick", "--px", "64", "--out", str(out), "--no-progress"])
    assert args.func(args) == 0
    raw = json.loads((out / "results.json").read_text())
    assert set(raw["summary"]) == {"clean", "never", "swap@4", "restart@4"}
    results = harness.read_results(out / "results.json", sv.VQAConfig, sv.VQARow)
    assert len(results.rows) == 5 * 4 and {r.kind for r in results.rows} == {
        "count-colour", "count-shape", "colour", "digit", "sum"}
    assert all(r.forward_passes > 0 and r.tokens_encoded > 0 for r in results.rows)
    assert (out / "report.md").read_text().startswith("# ShardedVQA")
    assert (out / "sharded_vqa.png").stat().st_size > 1000
