"""User-supplied inputs of `cothink eval`: --problems (JSON Lines) and --script (JSON / YAML), validated
before any model loads and read by the suites that use them."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import subprocess
import sys

import pytest

from cothink.errors import InvalidParameterError
from cothink.eval import cli, models
from cothink.eval.common import PASS, SuiteContext
from cothink.eval.suites import consistency
from cothink.eval.workload import UserProblem, load_problems

PROBLEMS = [
    {"question": "What is 17 plus 25? End with 'Answer: <number>'.", "answer": 42},
    {"question": "Name the colour of a clear daytime sky.", "answer": "blue"},
]


def _write_problems(path, items=PROBLEMS):
    path.write_text("# a comment line\n" + "\n".join(json.dumps(x) for x in items) + "\n\n")
    return path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cothink")
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser


def test_load_problems(tmp_path):
    probs = load_problems(_write_problems(tmp_path / "p.jsonl"))
    assert probs == [UserProblem(PROBLEMS[0]["question"], "42"), UserProblem(PROBLEMS[1]["question"], "blue")]
    assert probs[0].operands == (17, 25) and probs[0].steps == ()
    # a number is matched against the last number of the text, anything else as text
    assert probs[0].is_correct("17 + 25 = 42. Answer: 42") and not probs[0].is_correct("Answer: 42 or 43")
    assert probs[1].is_correct("It is  Blue.") and not probs[1].is_correct("grey")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"question": "q", "answer": 1}\n{"question": "q2"}\n', "line 2: answer: Field required"),
        ('{"question": "", "answer": 1}\n', "line 1: question"),
        ('{"question": "q", "answer": 1, "hint": "x"}\n', "line 1: hint: Extra inputs"),
        ("not json\n", "line 1: not JSON"),
        ("# only a comment\n", "no problems"),
    ],
)
def test_problem_file_errors_name_the_line(tmp_path, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(InvalidParameterError, match=message):
        load_problems(path)


def test_consistency_solves_the_users_problems(tmp_path):
    tiny = models.load(str(models.build_tiny_model(tmp_path / "tiny")))
    path = _write_problems(tmp_path / "p.jsonl")
    p = dataclasses.replace(
        consistency.plan(True), thinker_tokens=12, narrate_every=4, narrations=2, problems_file=str(path)
    )
    res = asyncio.run(consistency.run(SuiteContext(tiny, True, tmp_path), p))
    assert [r["problem"] for r in res.records] == [x["question"] for x in PROBLEMS]
    assert [r["answer"] for r in res.records] == ["42", "blue"]
    probs = load_problems(path)
    for prob, r in zip(probs, res.records):
        assert r["correct"] == prob.is_correct(r["narrated_text"])
    checks = {c.name: c.status for c in res.checks}
    assert checks["thinker tokens identical with and without the narrator (greedy)"] == PASS
    assert any(str(path) in c for c in res.conditions)


def test_user_files_go_into_the_plans_of_the_suites_that_read_them(tmp_path):
    problems = _write_problems(tmp_path / "p.jsonl")
    script = tmp_path / "w.json"
    script.write_text(json.dumps({"events": [{"at": 0, "op": "start", "coroutine": "a", "text": "hi"}]}))
    args = _parser().parse_args(
        [
            "eval",
            "all",
            "--quick",
            "--script",
            str(script),
            "--problems",
            str(problems),
            "--out",
            str(tmp_path),
        ]
    )
    inv = cli._invocation(args)
    assert inv.plans["latency"].script == str(script)
    assert inv.plans["consistency"].problems_file == str(problems)
    assert inv.plans["cost"] == cli._suite_modules()["cost"].plan(True, None)


def test_bad_user_files_stop_the_run_before_any_model_loads(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("events:\n  - {at: 0, op: generate, coroutine: nobody}\n")
    for argv, message in [
        (["eval", "latency", "--script", str(bad)], "'nobody' is never started"),
        (["eval", "latency", "--script", str(tmp_path / "missing.yaml")], "No such file"),
        (["eval", "cost", "--problems", str(_write_problems(tmp_path / "p.jsonl"))], "consistency suite"),
    ]:
        args = _parser().parse_args([*argv, "--models", "no-such-model", "--out", str(tmp_path / "out")])
        assert args.func(args) == 2
        assert message in capsys.readouterr().err


def test_help_shows_the_user_input_options():
    out = subprocess.run(
        [sys.executable, "-m", "cothink.eval", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "--script FILE" in out.stdout and "--problems FILE" in out.stdout


def test_the_documented_examples_are_valid(tmp_path):
    import re
    from pathlib import Path

    from cothink.eval.script import load_script

    docs = (Path(__file__).parents[2] / "docs" / "evaluation.md").read_text()
    script = tmp_path / "example.yaml"
    script.write_text(re.search(r"```yaml\n(.*?)```", docs, re.S).group(1))
    assert [e.op for e in load_script(script).events] == [
        "start",
        "generate",
        "start",
        "probe",
        "extend",
        "generate",
    ]
    problems = tmp_path / "example.jsonl"
    problems.write_text(re.search(r"```\n(.*?)```", docs[docs.index("## Problem sets") :], re.S).group(1))
    assert [p.answer for p in load_problems(problems)] == ["42", "blue"]
