"""Small matplotlib (Agg) helpers: every plot is one PNG, small enough to commit."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DPI = 80


def lines(
    path: Path,
    title: str,
    xlabel: str,
    panels: Sequence[tuple[str, Sequence[tuple[str, Sequence[float], Sequence[float]]]]],
    *,
    logx: bool = False,
    logy: Sequence[bool] | None = None,
    marker: str = "o",
) -> Path:
    """panels: [(ylabel, [(label, xs, ys), ...]), ...] drawn side by side."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.6), squeeze=False)
    for i, (ax, (ylabel, series)) in enumerate(zip(axes[0], panels)):
        for label, xs, ys in series:
            ax.plot(list(xs), list(ys), marker=marker, markersize=4, label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if logx:
            ax.set_xscale("log", base=2)
        if logy is not None and logy[i]:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def bars(
    path: Path,
    title: str,
    groups: Sequence[str],
    series: Sequence[tuple[str, Sequence[float]]],
    ylabel: str,
    *,
    logy: bool = False,
) -> Path:
    fig, ax = plt.subplots(figsize=(max(6.4, 1.0 * len(groups)), 3.6 if len(groups) < 6 else 4.2))
    width = 0.8 / max(1, len(series))
    for j, (label, ys) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, list(ys), width=width, label=label)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=7 if len(groups) > 5 else 8)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
