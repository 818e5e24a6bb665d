"""MATH-500-Sharded: the splitter, the shards file format, scoring, and a --quick run on a tiny hybrid."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cothink.experiments import harness
from cothink.experiments import math500_sharded as m5

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "math500" / "test.jsonl"
needs_data = pytest.mark.skipif(not DATA.exists(), reason="MATH-500 test.jsonl not available")


def test_split_removes_one_condition_sentence():
    s = m5.split_problem("u1", "Let $x = 3$. A box holds $x$ apples. How many apples are in 2 boxes?", "6")
    assert s is not None
    assert s.supplement == "Let $x = 3$."
    assert s.partial == "A box holds $x$ apples. How many apples are in 2 boxes?"
    assert s.answer == "6"


def test_split_if_clause_and_math_punctuation():
    s = m5.split_problem("u2", "If $f(x) = 2x + 1$, what is $f(3)$? Express your answer as an integer.", "7")
    assert s is not None and s.supplement == "If $f(x) = 2x + 1$."
    assert s.partial == "What is $f(3)$? Express your answer as an integer."
    # a sentence that ends inside display math, with the next one glued to it
    s = m5.split_problem("u3", "Define \\[p = 1 + 2.\\]Find $p^2.$", "9")
    assert s is not None and s.supplement == "Define \\[p = 1 + 2.\\]" and s.partial == "Find $p^2.$"


def test_unsplittable_problems_are_listed():
    problems = [
        m5.Problem("a", "How many positive divisors does 196 have?", "9"),
        m5.Problem("b", "Let $n = 4$. What is $n^2$?", "16"),
    ]
    shards, skipped = m5.build_shards(problems)
    assert [s.unique_id for s in shards] == ["b"] and skipped == ["a"]
    # periods inside math never end a sentence
    assert m5._sentences("Let $a = 1.5$ and $b = 2$. Find $a + b$.") == [
        "Let $a = 1.5$ and $b = 2$.",
        "Find $a + b$.",
    ]


@needs_data
def test_splitter_is_deterministic_on_math500():
    problems = m5.load_problems(DATA)
    a, skipped_a = m5.build_shards(problems)
    b, _ = m5.build_shards(problems)
    assert a == b and len(a) >= 250 and len(a) + len(skipped_a) == len(problems)
    for s in a:
        assert s.supplement and s.partial and s.supplement not in s.partial


def test_shards_round_trip(tmp_path):
    shards = [m5.Shard(unique_id="x/1", partial="Find $y$.", supplement="Let $y = 2$.", answer="2")]
    path = m5.write_shards(tmp_path / "s.jsonl", shards)
    assert json.loads(path.read_text().splitlines()[0]) == {
        "unique_id": "x/1",
        "partial": "Find $y$.",
        "supplement": "Let $y = 2$.",
        "answer": "2",
    }
    assert m5.read_shards(path) == shards


def test_boxed_extraction_and_scoring():
    assert m5.extract_boxed("so \\boxed{1} then \\boxed{\\frac{14}{3}} done") == "\\frac{14}{3}"
    assert m5.extract_boxed("no box") is None
    assert m5.cued_answer("\\frac{1}{2}}$ and more") == "\\frac{1}{2}"
    assert m5.is_correct("14/3", "\\frac{14}{3}") and not m5.is_correct("5", "\\frac{14}{3}")
    assert not m5.is_correct(None, "1")


def test_step_counter_lines_or_tokens():
    c = m5.StepCounter(step_tokens=4)
    c.feed("a = 1\n", 3)
    assert c.steps == 1
    c.feed("\n\n", 2)  # empty lines are not steps
    assert c.steps == 1
    c.feed("bbbb", 4)  # no newline: 4 tokens make a step
    assert c.steps == 2


def test_cli_registration_and_arguments():
    parser = argparse.ArgumentParser()
    harness.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["experiment", "math500-sharded", "--steps", "4,0,2", "--quick", "--limit", "3"])
    assert args.func is m5.run and args.steps == [0, 2, 4] and args.quick and args.limit == 3
    assert args.max_tokens == 160 and args.conditions == list(m5.CONDITIONS)
    with pytest.raises(SystemExit):
        parser.parse_args(["experiment", "math500-sharded", "--conditions", "full,bogus"])


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory) -> Path:
    from cothink.eval.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "hybrid", hybrid=True, seed=3)


TWO_SHARDS = [
    m5.Shard(
        unique_id="t/1",
        partial="A box holds $x$ apples. How many apples are in 2 boxes?",
        supplement="Let $x = 3$.",
        answer="6",
    ),
    m5.Shard(unique_id="t/2", partial="What is $f(3)$?", supplement="If $f(x) = 2x + 1$.", answer="7"),
]


def _quick_args(model: Path, shards_file: Path, out: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    harness.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(
        [
            "experiment",
            "math500-sharded",
            "--model",
            str(model),
            "--shards",
            str(shards_file),
            "--quick",
            "--max-tokens",
            "12",
            "--step-tokens",
            "4",
            "--steps",
            "0,1,2",
            "--out",
            str(out),
            "--no-progress",
            *extra,
        ]
    )


def test_quick_run_rows_and_mid_generation_insertion(tiny_hybrid, tmp_path):
    shards_file = m5.write_shards(tmp_path / "shards.jsonl", TWO_SHARDS)
    out = tmp_path / "out"
    args = _quick_args(tiny_hybrid, shards_file, out)
    assert args.func(args) == 0
    results = harness.read_results(out / "results.json", m5.MathConfig, m5.MathRow)
    raw = json.loads((out / "results.json").read_text())
    assert set(raw) == {"config", "rows", "summary"}
    assert (out / "report.md").exists() and (out / "math500_sharded.png").stat().st_size > 1000
    rows = results.rows
    assert len(rows) == 2 * (2 + 2 * 3)
    for row in raw["rows"]:
        assert {
            "unique_id",
            "condition",
            "k",
            "correct",
            "answer",
            "tokens_generated",
            "tokens_encoded",
            "forward_passes",
            "seconds",
        } <= set(row)
    for r in rows:
        assert r.forward_passes > 0 and r.tokens_encoded > 0 and r.tokens_generated > 0
        assert (r.k is None) == (r.condition in ("full", "partial"))
    assert set(results.summary) == {"full", "partial", "insert", "restart"}
    assert set(results.summary["insert"]) == {"0", "1", "2"} and set(results.summary["full"]) == {"-"}
    for r in rows:
        if r.condition == "insert" and r.k:
            # the supplement went in after k steps of thinking, and the thinker kept generating after it
            assert r.supplement_after_steps == r.k
            assert r.supplement_after_tokens >= r.k * 1
            assert r.tokens_generated > r.supplement_after_tokens
        if r.condition == "restart" and r.k:
            same = next(
                x for x in rows if x.unique_id == r.unique_id and x.condition == "insert" and x.k == r.k
            )
            # the text-passing baseline re-encodes the thoughts written before the supplement
            assert r.tokens_encoded > same.tokens_encoded


@needs_data
def test_write_shards_flag_saves_the_builtin_split(tmp_path):
    parser = argparse.ArgumentParser()
    harness.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "shards.jsonl"
    args = parser.parse_args(
        ["experiment", "math500-sharded", "--data", str(DATA), "--write-shards", str(out)]
    )
    assert args.func(args) == 0
    expected, _ = m5.build_shards(m5.load_problems(DATA))
    assert m5.read_shards(out) == expected


def test_resume_keeps_finished_problems_and_runs_the_rest(tiny_hybrid, tmp_path):
    shards_file = m5.write_shards(tmp_path / "shards.jsonl", TWO_SHARDS)
    out = tmp_path / "out"
    first = _quick_args(tiny_hybrid, shards_file, out, "--limit", "1")
    assert first.func(first) == 0
    saved = harness.read_results(out / "results.json", m5.MathConfig, m5.MathRow)
    assert {r.unique_id for r in saved.rows} == {"t/1"}

    more = _quick_args(tiny_hybrid, shards_file, out, "--limit", "2", "--resume")
    assert more.func(more) == 0
    resumed = harness.read_results(out / "results.json", m5.MathConfig, m5.MathRow)
    assert [r for r in resumed.rows if r.unique_id == "t/1"] == saved.rows  # kept as saved, not rerun
    assert len([r for r in resumed.rows if r.unique_id == "t/2"]) == len(m5.cases(resumed.config))
    assert [p.units for p in resumed.config.earlier_parts] == [1]
    assert resumed.config.earlier_parts[0].started_at == saved.config.started_at
    assert resumed.config.problems == 2
    assert "resumed run" in (out / "report.md").read_text()

    # a problem cut off mid-way (one of its rows missing) is run again, whole
    raw = json.loads((out / "results.json").read_text())
    raw["rows"] = [r for r in raw["rows"] if not (r["unique_id"] == "t/2" and r["condition"] == "full")]
    (out / "results.json").write_text(json.dumps(raw))
    again = _quick_args(tiny_hybrid, shards_file, out, "--limit", "2", "--resume")
    assert again.func(again) == 0
    final = harness.read_results(out / "results.json", m5.MathConfig, m5.MathRow)
    assert len(final.rows) == 2 * len(m5.cases(final.config))
    assert [p.units for p in final.config.earlier_parts] == [1, 0]
    assert [r for r in final.rows if r.unique_id == "t/1"] == saved.rows


def test_resume_refuses_a_run_with_other_settings(tiny_hybrid, tmp_path):
    shards_file = m5.write_shards(tmp_path / "shards.jsonl", TWO_SHARDS)
    out = tmp_path / "out"
    first = _quick_args(tiny_hybrid, shards_file, out, "--limit", "1")
    assert first.func(first) == 0
    before = (out / "results.json").read_text()
    other = _quick_args(tiny_hybrid, shards_file, out, "--resume", "--step-tokens", "5")
    with pytest.raises(harness.ResumeMismatchError, match="step_tokens"):
        other.func(other)
    assert (out / "results.json").read_text() == before  # nothing lost


def test_reading_pairs_insert_and_restart_by_problem():
    """The reading counts, per k, the problems only one of insert / restart solved, and tests them."""
    def row(uid: str, condition: str, k: int | None, correct: bool, encoded: int = 5) -> m5.MathRow:
        return m5.MathRow(unique_id=uid, condition=condition, k=k, correct=correct, answer=None, gold="1",
                          tokens_generated=10, tokens_encoded=encoded, forward_passes=10, seconds=1.0)

    rows = []
    for i in range(8):  # problem i: restart right on all 8, insert only on the first 2
        uid = f"p{i}"
        rows += [row(uid, "full", None, True), row(uid, "partial", None, False),
                 row(uid, "insert", 1, i < 2), row(uid, "restart", 1, True, encoded=5 - (i == 0))]
    assert m5._discordant(rows, "insert", "restart", 1) == (0, 6)
    config = argparse.Namespace(steps=[1])
    results = argparse.Namespace(config=config, rows=rows)
    lines = m5._reading(results, m5.cost_table(rows))
    line = next(x for x in lines if x.startswith("- k=1"))
    assert "only insert right on 0 problems, only restart on 6" in line
    assert "(restart, +0 re-encoded)" in line  # a fraction of a token fewer reads as none, not "+-0"
    assert f"p = {harness.paired_p_value(0, 6):.2g}" in line and "p = 0.031" in line
