"""The shared experiment harness: every paper experiment is one module on top of this file.

An experiment module (``cothink/experiments/<name>.py``) defines

- a config record (a pydantic model, subclass of :class:`ExperimentConfig`) holding every knob that
  changes the numbers, written verbatim into the results;
- a row record (subclass of :class:`Row`): one measured unit (a problem under a condition, an episode,
  a task), typed, never a string-keyed dict;
- ``configure(parser)`` adding its own flags (after :func:`add_common_arguments` added the shared ones),
  ``run(args) -> int`` doing the work;
- ``EXPERIMENT = Experiment(name, help, description, configure, run)``.

and registers in one line: its module path in :data:`EXPERIMENT_MODULES`. ``cothink experiment NAME``
then exists, with ``--help``.

What the harness gives every experiment:

- :func:`add_common_arguments`: ``--model`` (smollm2, qwen35-random or a local folder), ``--dtype``,
  ``--seed``, ``--limit``, ``--quick``, ``--max-tokens``, ``--threads``, ``--out``;
- :func:`load_model`: the model loaded once (weights shared), fresh engines from
  ``ModelHandle.engine(**limits)``;
- :class:`Results`: ``DIR/results.json`` = ``{"config": {...}, "rows": [...], "summary": {...}}``
  (:func:`write_results` / :func:`read_results`);
- :class:`ResultsFolder`: an experiment's summary, report and plot functions bound to its folder:
  ``save`` writes results.json and report.md after every unit (a run cut short keeps its rows) and the
  plot at the end; ``render`` redoes all three from a saved results.json;
- :func:`begin`: stamps a config with its start time, the commit and the machine;
- :func:`write_report`: ``DIR/report.md`` from markdown text, with :func:`markdown_table` to build it;
- :func:`plot_lines`: PNG line plots with matplotlib (Agg backend, headless), one or more panels;
  :func:`figure` for other plots (panels side by side, saved as PNG on exit);
- :func:`progress`: a rich progress bar (silent when output is not a terminal unless forced);
- :func:`optional_import`: a dependency of the ``experiments`` extra (vizdoom, math-verify), or
  :class:`MissingExtraError` naming the extra to install; the core install (engine, server, ``cothink
  --help``) never imports them;
- :func:`machine_info`: the commit, CPU, cores, torch version and threads (``config.machine``, in every
  results.json), for the report header.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import time
from types import ModuleType
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from cothink.errors import CothinkError
from cothink.run_info import now_utc, run_info

# One line per experiment: the module must define EXPERIMENT (an Experiment).
EXPERIMENT_MODULES: tuple[str, ...] = (
    "cothink.experiments.math500_sharded",
    "cothink.experiments.vizdoom",
    "cothink.experiments.monitor",
    "cothink.experiments.stream_commentary",
    "cothink.experiments.sharded_vqa",
)

DTYPES = ("float32", "bfloat16")


EXTRA = "experiments"  # the optional dependencies the experiments need: pip install 'cothink[experiments]'


class MissingExtraError(CothinkError, ImportError):
    """An experiment needs a package of the ``experiments`` extra that is not installed."""


def optional_import(module: str, needed_by: str) -> ModuleType:
    """Import `module` (a dependency of the ``experiments`` extra) for `needed_by`, or raise
    :class:`MissingExtraError` saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{needed_by} needs the {module!r} package: pip install 'cothink[{EXTRA}]'"
        ) from exc


# ------------------------------------------------------------------------------------------ records


class RunPart(BaseModel):
    """An earlier invocation of a run that was continued with ``--resume``: where, when and how long it
    ran, and how many units (problems, episodes) it finished."""

    machine: dict[str, Any]
    started_at: str
    wall_s: float
    units: int


class ExperimentConfig(BaseModel):
    """Knobs shared by every experiment; subclasses add their own fields. ``machine``, ``started_at`` and
    ``wall_s`` describe the latest invocation; a resumed run lists the ones before it in ``earlier_parts``."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    experiment: str
    model: str
    dtype: str = "float32"
    seed: int = 0
    limit: int | None = None
    quick: bool = False
    max_tokens: int = 128
    threads: int | None = None
    model_description: str = ""
    machine: dict[str, Any] = {}
    started_at: str = ""
    wall_s: float = 0.0
    earlier_parts: list[RunPart] = []


class Row(BaseModel):
    """One measured unit of an experiment; subclasses declare the columns."""

    model_config = ConfigDict(extra="forbid")


ConfigT = TypeVar("ConfigT", bound=ExperimentConfig)
RowT = TypeVar("RowT", bound=Row)


class Results(BaseModel, Generic[ConfigT, RowT]):
    """What ``DIR/results.json`` holds: the config, every row, and a summary computed from the rows."""

    config: ConfigT
    rows: list[RowT]
    summary: dict[str, Any]


def write_results(out: Path, results: Results[Any, Any]) -> Path:
    return _write_text(out / "results.json", results.model_dump_json(indent=1) + "\n")


def _write_text(path: Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file renamed into place: a run stopped mid-write
    (a kill, a full disk) leaves the previous file whole, never a truncated one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def read_results(path: Path, config_type: type[ConfigT], row_type: type[RowT]) -> Results[ConfigT, RowT]:
    """Parse a results.json back into typed records (raises pydantic.ValidationError on a bad file)."""
    return Results[config_type, row_type].model_validate_json(Path(path).read_text())  # type: ignore[valid-type]


class ResumeMismatchError(CothinkError, ValueError):
    """``--resume`` found a saved run whose settings differ from this invocation's in a field that changes
    the results."""


def resume(
    out: Path,
    config: ConfigT,
    row_type: type[RowT],
    *,
    unit: Callable[[RowT], str],
    rows_per_unit: int,
    same: Sequence[str],
) -> list[RowT]:
    """Continue the run saved in ``out/results.json``: the rows of its finished units (a unit, named by
    ``unit(row)``, is finished when it has ``rows_per_unit`` rows; a unit cut off mid-way is run again),
    and ``config.earlier_parts`` extended with the saved invocation. No saved run: no rows.

    Raises :class:`ResumeMismatchError` when a field named in ``same`` (those that change what a row
    measures: model, dtype, budgets...) differs; speed settings (concurrency, threads) may change."""
    path = out / "results.json"
    if not path.exists():
        return []
    saved = read_results(path, type(config), row_type)
    differ = [f for f in same if getattr(saved.config, f) != getattr(config, f)]
    if differ:
        detail = ", ".join(
            f"{f}: saved {getattr(saved.config, f)!r}, now {getattr(config, f)!r}" for f in differ
        )
        raise ResumeMismatchError(f"cannot resume {path}: {detail}")
    per_unit: dict[str, list[RowT]] = {}
    for row in saved.rows:
        per_unit.setdefault(unit(row), []).append(row)
    finished = {u for u, rows in per_unit.items() if len(rows) == rows_per_unit}
    before = sum(part.units for part in saved.config.earlier_parts)
    config.earlier_parts = [
        *saved.config.earlier_parts,
        RunPart(
            machine=saved.config.machine,
            started_at=saved.config.started_at,
            wall_s=saved.config.wall_s,
            units=len(finished) - before,
        ),
    ]
    return [r for r in saved.rows if unit(r) in finished]


def parts_line(config: ExperimentConfig, unit_name: str) -> str:
    """A report's account of a resumed run's invocations (empty for a run made in one go)."""
    if not config.earlier_parts:
        return ""
    parts = [
        f"{p.units} {unit_name} in {p.wall_s / 60:.0f} min from {p.started_at} ({machine_line(p.machine)})"
        for p in config.earlier_parts
    ]
    return f"- resumed run; earlier invocations: {'; '.join(parts)}; the latest is the machine line above"


def begin(config: ExperimentConfig) -> float:
    """Stamp `config` with the start time (UTC) and the machine; returns perf_counter() for its wall_s."""
    config.started_at = now_utc()
    config.machine = machine_info()
    return time.perf_counter()


@dataclass(frozen=True)
class ResultsFolder(Generic[ConfigT, RowT]):
    """How an experiment writes its output folder, from its own summary, report and plot functions.

    ``report(results, folder)`` gets the folder too, for side files it reads (traces, per-episode logs);
    ``plot(path, summary)`` draws ``folder/plot_name``."""

    config_type: type[ConfigT]
    row_type: type[RowT]
    summarize: Callable[[Sequence[RowT]], dict[str, Any]]
    report: Callable[[Results[ConfigT, RowT], Path], str]
    plot: Callable[[Path, dict[str, Any]], Path]
    plot_name: str

    def save(self, out: Path, config: ConfigT, rows: list[RowT], *, final: bool) -> Results[ConfigT, RowT]:
        """Write results.json and report.md (call after every unit, so a run cut short keeps its rows);
        the plot when `final`."""
        results = Results[self.config_type, self.row_type](  # type: ignore[name-defined]
            config=config, rows=rows, summary=self.summarize(rows)
        )
        write_results(out, results)
        write_report(out, self.report(results, out))
        if final:
            self.plot(out / self.plot_name, results.summary)
        return results

    def render(self, out: Path) -> Results[ConfigT, RowT]:
        """Recompute the summary, report and plot of a saved results.json (e.g. of a run cut short)."""
        saved = read_results(out / "results.json", self.config_type, self.row_type)
        return self.save(out, saved.config, saved.rows, final=True)


# -------------------------------------------------------------------------------------------- report


def write_report(out: Path, markdown: str) -> Path:
    return _write_text(out / "report.md", markdown.rstrip() + "\n")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}"
        return "" if v is None else str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def proportion_ci(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion (95 % by default): unlike the normal approximation it
    stays inside [0, 1] and is not empty at 0 or n successes, which small experiment counts often are."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_p_value(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar test of two conditions run on the same items: `only_a` items only A got
    right, `only_b` only B. Items both got right or both wrong say nothing about which is better, so
    under "no difference" each discordant item is a fair coin: p = 2 P(Binomial(n, 1/2) <= min)."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1)) / 2**n
    return min(1.0, 2 * tail)


def format_proportion(successes: int, n: int) -> str:
    """`k/n (p, 95 % CI lo-hi)` for a report table."""
    lo, hi = proportion_ci(successes, n)
    share = successes / n if n else 0.0
    return f"{successes}/{n} ({share:.2f}, {lo:.2f}-{hi:.2f})"


@dataclass(frozen=True)
class Series:
    """One line on a plot: y over x, optionally a flat reference (x is None: drawn as a horizontal line)."""

    label: str
    x: Sequence[float] | None
    y: Sequence[float]
    style: str = "-o"


@dataclass(frozen=True)
class Panel:
    title: str
    xlabel: str
    ylabel: str
    series: Sequence[Series]


@contextmanager
def figure(path: Path, panels: int, *, width: float = 5.5, height: float = 4.2) -> Iterator[list[Any]]:
    """`panels` matplotlib axes side by side (headless, Agg), each `width` x `height` inches; the figure
    is laid out and saved to `path` (PNG, 110 dpi) when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(width * panels, height), squeeze=False)
    try:
        yield list(axes[0])
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def plot_lines(path: Path, panels: Sequence[Panel], title: str = "") -> Path:
    """Draw panels side by side into a PNG (headless matplotlib)."""
    with figure(path, len(panels)) as axes:
        _draw_lines(axes, panels)
        if title:
            axes[0].figure.suptitle(title)
    return path


def _draw_lines(axes: list[Any], panels: Sequence[Panel]) -> None:
    for ax, panel in zip(axes, panels):
        for s in panel.series:
            if s.x is None:
                ax.axhline(
                    s.y[0], linestyle="--", label=s.label, color="gray" if "partial" in s.label else None
                )
            else:
                ax.plot(list(s.x), list(s.y), s.style, label=s.label)
        ax.set_title(panel.title)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


# ------------------------------------------------------------------------------------------ progress


@contextmanager
def progress(total: int, description: str, *, enabled: bool | None = None) -> Iterator[Callable[[int], None]]:
    """A rich progress bar; yields ``advance(n=1)``. Shown on a terminal (or when enabled=True)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.progress import TimeRemainingColumn

    console = Console(stderr=True)
    show = console.is_terminal if enabled is None else enabled
    if not show:
        yield lambda n=1: None
        return
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)


# ------------------------------------------------------------------------------------------- machine


def machine_info() -> dict[str, Any]:
    """The run's provenance (:func:`cothink.run_info.run_info`: commit, dirty flag, CPU model, cores,
    torch version and threads, Python, start time), as ``config.machine`` records it."""
    return run_info().as_dict()


def machine_line(machine: dict[str, Any]) -> str:
    """``config.machine`` for a report: the CPU, torch and the commit (a results.json written before the
    commit was recorded lacks it)."""
    commit = str(machine.get("commit", "unknown"))[:12]
    dirty = " with uncommitted changes" if machine.get("dirty") else ""
    return f"{machine.get('cpu', '?')}, torch {machine.get('torch', '?')}, commit {commit}{dirty}"


# -------------------------------------------------------------------------------------------- models


def load_model(model: str, dtype: str = "float32", max_context: int = 8192) -> Any:
    """Load 'smollm2', 'qwen35-random' or a local folder once; returns a ``cothink.eval.models.ModelHandle``
    (``.engine(**limits)`` makes a fresh engine over the shared weights, ``.description`` names it)."""
    import torch

    from cothink.eval.models import load

    return load(model, {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype], max_context=max_context)


# ----------------------------------------------------------------------------------------------- CLI


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


@dataclass(frozen=True)
class Experiment:
    """An experiment as the CLI sees it."""

    name: str
    help: str
    description: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    default_max_tokens: int = 128


def add_common_arguments(p: argparse.ArgumentParser, *, name: str, default_max_tokens: int = 128) -> None:
    p.add_argument(
        "--model",
        default="smollm2",
        help="smollm2, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b (embedded: `cothink prepare` them first), "
        "qwen35-random or a local model folder (default: smollm2)",
    )
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype (default: float32)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--limit", type=_positive_int, default=None, help="run at most N items (default: all)")
    p.add_argument("--quick", action="store_true", help="a small smoke run (few items, few tokens)")
    p.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=default_max_tokens,
        help=f"most tokens a generation writes (default: {default_max_tokens})",
    )
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("results") / name,
        help=f"output folder for results.json, report.md and plots (default: results/{name})",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar (default: on a terminal)",
    )


def experiments() -> list[Experiment]:
    return [importlib.import_module(m).EXPERIMENT for m in EXPERIMENT_MODULES]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cothink experiment <name>`` for every module in EXPERIMENT_MODULES."""
    p = subparsers.add_parser(
        "experiment",
        help="run one of the paper's experiments (results.json, report.md, plots)",
        description="Run a paper experiment on a model; each writes DIR/results.json "
        "({config, rows, summary}), DIR/report.md and PNG plots.",
    )
    sub = p.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    for exp in experiments():
        q = sub.add_parser(exp.name, help=exp.help, description=exp.description)
        add_common_arguments(q, name=exp.name, default_max_tokens=exp.default_max_tokens)
        exp.configure(q)
        q.set_defaults(func=exp.run)
    return p
