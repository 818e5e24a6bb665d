"""The shared experiment harness: a results folder written after every unit and re-rendered from a saved
results.json; figures saved on success and closed either way."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from cothink.experiments import harness


class ToyConfig(harness.ExperimentConfig):
    knob: int


class ToyRow(harness.Row):
    name: str
    value: float


def _summarize(rows: Sequence[ToyRow]) -> dict[str, Any]:
    return {"n": len(rows), "mean": statistics.fmean(r.value for r in rows)}


def _report(results: harness.Results[ToyConfig, ToyRow], out: Path) -> str:
    side = (out / "side.txt").read_text().strip() if (out / "side.txt").exists() else "-"
    return f"# toy\n\nknob {results.config.knob}, mean {results.summary['mean']}, side {side}\n"


def _plot(path: Path, summary: dict[str, Any]) -> Path:
    with harness.figure(path, 2, width=3.0) as axes:
        assert len(axes) == 2
        axes[0].bar(["mean"], [summary["mean"]])
    return path


FOLDER = harness.ResultsFolder(ToyConfig, ToyRow, _summarize, _report, _plot, "toy.png")


def test_results_folder_saves_and_renders(tmp_path):
    config = ToyConfig(experiment="toy", model="none", knob=3)
    t0 = harness.begin(config)
    assert config.started_at.endswith("Z") and config.machine["cores"] and t0 > 0
    rows = [ToyRow(name="a", value=1.0)]
    FOLDER.save(tmp_path, config, rows, final=False)  # after a unit: no plot yet
    assert not (tmp_path / "toy.png").exists()
    assert json.loads((tmp_path / "results.json").read_text())["summary"] == {"n": 1, "mean": 1.0}
    rows.append(ToyRow(name="b", value=3.0))
    (tmp_path / "side.txt").write_text("seen\n")  # the report reads side files through the folder
    saved = FOLDER.save(tmp_path, config, rows, final=True)
    assert saved.summary["mean"] == 2.0 and (tmp_path / "toy.png").stat().st_size > 500
    assert "knob 3, mean 2.0, side seen" in (tmp_path / "report.md").read_text()
    # a saved folder re-renders to the same files
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    (tmp_path / "report.md").unlink()
    (tmp_path / "toy.png").unlink()
    again = FOLDER.render(tmp_path)
    assert again.rows == saved.rows and again.config == saved.config
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_figure_closes_and_saves_nothing_on_error(tmp_path):
    import matplotlib.pyplot as plt

    open_before = len(plt.get_fignums())
    with pytest.raises(RuntimeError):
        with harness.figure(tmp_path / "bad.png", 1):
            raise RuntimeError("drawing failed")
    assert not (tmp_path / "bad.png").exists() and len(plt.get_fignums()) == open_before
