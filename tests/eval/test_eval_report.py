"""The results folder: report.md has all seven sections, raw JSON/CSV, plots."""

from __future__ import annotations

import csv
import json

from cothink.eval import report
from cothink.eval.cli import SUITE_NAMES, _suite_modules
from cothink.eval.common import SuiteResult, Table

CONFIG = {
    "command": "cothink eval all --quick",
    "quick": True,
    "dtype": "float32",
    "torch_threads": 1,
    "torch_threads_reason": "test",
    "cpu_model": "cpu",
    "cpu_count": 2,
    "memory_gib": 1.0,
    "versions": {"torch": "t", "transformers": "tf", "cothink": "c", "python": "p"},
    "load_average_at_start": [0.0, 0.0, 0.0],
    "load_average_at_end": [1.0, 1.0, 1.0],
    "models": [{"name": "m", "description": "a model", "parameters": 1e6}],
}


def _result(suite: str, ok: bool = True) -> SuiteResult:
    r = SuiteResult(suite, "m", params={"x": 1})
    r.tables.append(Table("numbers", ["a", "b|c"], [[1, 2.5], ["x", "y"]], note="a note"))
    r.records = [{"a": 1, "b": [1, 2]}, {"a": 2, "c": "z"}]
    r.check("it holds", ok, "detail")
    r.conditions.append("under test conditions")
    r.plots.append(f"{suite}-m-plot.png")
    r.summary = f"{suite} summary line"
    r.elapsed_s = 1.5
    return r


def test_report_has_all_seven_sections_even_when_some_suites_did_not_run():
    results = [_result("sync-cost"), _result("faults", ok=False)]
    text = report.render(results, CONFIG, _suite_modules(), elapsed_s=12.0)
    assert [name for name, _ in report.SECTIONS] == list(SUITE_NAMES)
    assert all(module.NAME == name for name, module in _suite_modules().items())  # registered by its name
    for name, title in report.SECTIONS:
        assert f"## {title} (`{name}`)" in text
    assert text.count("_Not run in this invocation._") == 5
    assert "Command: `cothink eval all --quick`" in text
    assert "### sync-cost on m: PASS" in text and "### faults on m: FAIL" in text
    assert "- **FAIL** faults / m: it holds (detail)" in text  # failures are listed up front
    assert "| a | b\\|c |" in text  # table cells are escaped
    assert "![sync-cost m](sync-cost-m-plot.png)" in text
    assert "- under test conditions" in text
    assert "sync-cost summary line" in text
    for _, title in report.SECTIONS:  # the suite questions come from the suite modules
        assert title in text
    assert "**Question.**" in text


def test_report_plot_prefix():
    text = report.render(
        [_result("cost")], CONFIG, _suite_modules(), elapsed_s=1.0, plot_prefix="evaluation/"
    )
    assert "](evaluation/cost-m-plot.png)" in text


def test_write_raw(tmp_path):
    results = [_result("cost"), _result("soak")]
    report.write_raw(tmp_path, results)
    data = json.loads((tmp_path / "raw" / "cost-m.json").read_text())
    assert data["suite"] == "cost" and data["checks"][0]["status"] == "PASS"
    rows = list(csv.DictReader((tmp_path / "raw" / "cost-m.csv").open()))
    assert [r["a"] for r in rows] == ["1", "2"]
    assert set(rows[0]) == {"a", "b", "c"} and json.loads(rows[0]["b"]) == [1, 2]
    assert len(json.loads((tmp_path / "results.json").read_text())) == 2


def test_jsonable_handles_nan_and_objects():
    assert report._jsonable({"x": float("nan"), "y": (1, 2), 3: object}) == {
        "x": None,
        "y": [1, 2],
        "3": str(object),
    }
