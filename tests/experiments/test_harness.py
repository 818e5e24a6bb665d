"""The shared experiment harness: a results folder written after every unit and re-rendered from a saved
results.json; figures saved on success and closed either way."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from cothink.experiments import harness

ROOT = Path(__file__).resolve().parents[2]


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


def test_a_save_cut_short_keeps_the_previous_rows(tmp_path, monkeypatch):
    """A run stopped while it writes (here: the disk fills half-way) keeps the rows saved before."""
    config = ToyConfig(experiment="toy", model="none", knob=1)
    harness.begin(config)
    rows = [ToyRow(name="a", value=1.0)]
    FOLDER.save(tmp_path, config, rows, final=False)
    before = (tmp_path / "results.json").read_text()
    write_text = Path.write_text

    def half_then_full_disk(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        write_text(self, data[: len(data) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_full_disk)
    with pytest.raises(OSError):
        FOLDER.save(tmp_path, config, [*rows, ToyRow(name="b", value=3.0)], final=False)
    monkeypatch.undo()
    assert (tmp_path / "results.json").read_text() == before
    assert FOLDER.render(tmp_path).rows == rows


def test_figure_closes_and_saves_nothing_on_error(tmp_path):
    import matplotlib.pyplot as plt

    open_before = len(plt.get_fignums())
    with pytest.raises(RuntimeError):
        with harness.figure(tmp_path / "bad.png", 1):
            raise RuntimeError("drawing failed")
    assert not (tmp_path / "bad.png").exists() and len(plt.get_fignums()) == open_before


def test_results_record_the_commit_cpu_and_torch(tmp_path):
    """Every results.json names what it was measured on: the commit of the cothink that ran, the CPU
    model and torch's version."""
    import torch

    from cothink.run_info import cpu_model

    config = ToyConfig(experiment="toy", model="none", knob=1)
    harness.begin(config)
    FOLDER.save(tmp_path, config, [ToyRow(name="a", value=1.0)], final=False)
    machine = json.loads((tmp_path / "results.json").read_text())["config"]["machine"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    expected = head.stdout.strip() if head.returncode == 0 else "unknown"
    assert machine["commit"] == expected and isinstance(machine["dirty"], (bool, type(None)))
    assert machine["cpu"] == cpu_model() and machine["cpu"] != ""
    assert machine["torch"] == torch.__version__ and machine["started_at"].endswith("Z")
    assert expected[:12] in harness.machine_line(machine)


# The core install leaves out the `experiments` extra: with its packages unimportable, cothink, the
# engine, the server and the command line still import and run, and an experiment that needs one says
# which extra to install.
WITHOUT_EXTRA = """
import sys
sys.modules["math_verify"] = None
sys.modules["vizdoom"] = None
import cothink
import cothink.runtime.engine
import cothink.server
from cothink.cli import main
for argv in (["--help"], ["experiment", "--help"], ["experiment", "vizdoom", "--help"]):
    try:
        main(argv)
    except SystemExit as exit:
        assert exit.code in (0, None), (argv, exit.code)
from cothink.experiments import harness, math500_sharded, vizdoom_env
for call in (lambda: math500_sharded.is_correct("1", "1"), vizdoom_env._vizdoom):
    try:
        call()
    except harness.MissingExtraError as err:
        assert "pip install 'cothink[experiments]'" in str(err), err
        assert isinstance(err, ImportError)
    else:
        raise AssertionError("no MissingExtraError")
print("core ok")
"""


def test_core_install_runs_without_the_experiments_extra():
    done = subprocess.run([sys.executable, "-c", WITHOUT_EXTRA], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("core ok")


def test_proportion_ci_is_wilsons_interval():
    # textbook values of the 95 % Wilson score interval
    lo, hi = harness.proportion_ci(5, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.2366, 0.7634)
    lo, hi = harness.proportion_ci(0, 10)
    assert lo == 0.0 and round(hi, 4) == 0.2775
    lo, hi = harness.proportion_ci(10, 10)
    assert round(lo, 4) == 0.7225 and hi == 1.0
    assert harness.format_proportion(3, 21) == "3/21 (0.14, 0.05-0.35)"


def test_paired_p_value_is_the_exact_mcnemar_test():
    assert harness.paired_p_value(0, 0) == 1.0  # no discordant item: no evidence either way
    assert harness.paired_p_value(0, 6) == pytest.approx(2 / 64)  # six coins all one way
    assert harness.paired_p_value(6, 0) == harness.paired_p_value(0, 6)
    # 5 vs 10: 2 * sum C(15, 0..5) / 2^15
    assert harness.paired_p_value(5, 10) == pytest.approx(2 * 4944 / 32768)
    assert harness.paired_p_value(7, 7) == 1.0  # capped
