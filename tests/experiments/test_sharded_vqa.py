"""ShardedVQA on a tiny multimodal model with random weights (the runs are real; their answers say nothing
about any trained model): the conditions' exact relations (a swap at 0 and a restart are the full run;
a swap at k keeps the tampered run's first k thoughts), the cost of restarting, answer parsing, and
--quick runs through the CLI on generated pairs and on a pairs file."""

from __future__ import annotations

import argparse
import asyncio
import json

import numpy as np
import pytest

from cothink.errors import InvalidParameterError
from cothink.experiments import harness
from cothink.experiments import sharded_vqa as sv
from cothink.experiments.sharded_vqa_data import Pair, make_item, pair_of, save_pairs, sharded_vqa
from support import tiny_folder, tiny_vision_folder


def test_parse_answer():
    assert sv.parse_answer(" There are 3 red shapes, not 4", "count-colour") == "3"
    assert sv.parse_answer("It is Blue.", "colour") == "blue"
    assert sv.parse_answer("bluest", "colour") is None
    assert sv.parse_answer("none", "digit") is None
    pixels = np.zeros((8, 8, 3), np.uint8)
    number = Pair("p", "How many?", "12", "3", pixels, pixels)
    assert sv.parse_pair_answer("I count 12, not 3", number) == "12"
    assert sv.parse_pair_answer("twelve", number) is None
    word = Pair("p", "What colour?", "Green", "purple", pixels, pixels)
    assert sv.parse_pair_answer("It looks GREEN to me", word) == "green"
    assert sv.parse_pair_answer("purple, I think", word) == "purple"
    assert sv.parse_pair_answer("3", word) is None


def _config(**kw):
    base = dict(experiment=sv.NAME, model="m", data="seed:0", count=1, px=64, steps=[4],
                conditions=list(sv.CONDITIONS), answer_tokens=3, max_tokens=6, seed=0)
    return sv.VQAConfig(**{**base, **kw})


def test_conditions_relate_exactly():
    handle = harness.load_model(str(tiny_vision_folder("qwen35_vl")))
    pair = pair_of(make_item(0, 1, px=64))
    config = _config()

    def case(condition, k=None):
        return asyncio.run(sv.run_pair(handle, pair, condition, k, config))

    full, tampered = case("full"), case("tampered")
    swap0, swap4, restart4 = case("swap", 0), case("swap", 4), case("restart", 4)
    # a swap before any thought, and a restart from scratch, think and answer as the full run
    assert (swap0.thoughts, swap0.said) == (full.thoughts, full.said)
    assert (restart4.thoughts, restart4.said) == (full.thoughts, full.said)
    # a swap at 4 keeps the 4 tokens written over the tampered picture, then reads the corrected one
    tok = handle.tokenizer
    tampered_ids, swap_ids = tok.encode(tampered.thoughts), tok.encode(swap4.thoughts)
    assert swap_ids[:4] == tampered_ids[:4] and len(swap_ids) > 4
    assert swap4.tokens_generated == restart4.tokens_generated == 4 + config.max_tokens
    assert full.tokens_generated == tampered.tokens_generated == config.max_tokens
    # the restart encodes the question again: it costs more than the swap
    assert restart4.tokens_encoded > swap4.tokens_encoded > full.tokens_encoded
    for row in (full, tampered, swap4):
        assert row.correct == (row.answer == pair.answer_correct)
        assert row.answer_correct != row.answer_tampered
        assert row.pair_id == pair.pair_id and row.seconds > 0 and row.forward_passes > 0


def test_a_text_model_is_refused(tmp_path):
    with pytest.raises(InvalidParameterError, match="needs a vision model"):
        sv.run_experiment(_config(model=str(tiny_folder("llama"))),
                          [pair_of(it) for it in sharded_vqa(0, 1, px=64).items], tmp_path)
    assert not (tmp_path / "results.json").exists()


ROW_FIELDS = {"pair_id", "condition", "k", "correct", "answer", "tokens_generated", "tokens_encoded",
              "forward_passes", "seconds"}


def _cli(out, *extra):
    parser = argparse.ArgumentParser()
    harness.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["experiment", "sharded-vqa", "--model", str(tiny_vision_folder("qwen3_vl")),
                              "--quick", "--out", str(out), "--no-progress", *extra])
    return args.func(args)


def test_quick_run(tmp_path):
    out = tmp_path / "out"
    assert _cli(out, "--px", "64") == 0
    raw = json.loads((out / "results.json").read_text())
    assert set(raw["summary"]) == {"full", "tampered", "swap@4", "restart@4"}
    assert all(ROW_FIELDS <= set(row) for row in raw["rows"])
    results = harness.read_results(out / "results.json", sv.VQAConfig, sv.VQARow)
    assert len(results.rows) == 5 * 4 and {r.kind for r in results.rows} == {
        "count-colour", "count-shape", "colour", "digit", "sum"}
    assert all(r.forward_passes > 0 and r.tokens_encoded > 0 for r in results.rows)
    assert (out / "report.md").read_text().startswith("# ShardedVQA")
    assert (out / "sharded_vqa.png").stat().st_size > 1000


def test_quick_run_on_a_pairs_file(tmp_path):
    path = save_pairs(sharded_vqa(1, 2, px=64), tmp_path / "pairs")
    out = tmp_path / "out"
    assert _cli(out, "--pairs-file", str(path), "--conditions", "full", "swap") == 0
    results = harness.read_results(out / "results.json", sv.VQAConfig, sv.VQARow)
    assert results.config.data == str(path) and results.config.px is None
    assert [(r.pair_id, r.condition) for r in results.rows] == [
        ("sharded-vqa-1-0", "full"), ("sharded-vqa-1-0", "swap"),
        ("sharded-vqa-1-1", "full"), ("sharded-vqa-1-1", "swap")]
    assert all(r.kind is None and r.forward_passes > 0 for r in results.rows)
    assert set(results.summary) == {"full", "swap@4"}
