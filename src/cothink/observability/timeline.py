"""Step timelines: which coroutine ran in which forward pass, for Chrome/Perfetto and as a PNG.

Both take an iterable of StepRecord (``engine.timeline``):

    write_chrome_trace(engine.timeline, "trace.json")   # open in https://ui.perfetto.dev or chrome://tracing
    render_timeline_png(engine.timeline, "trace.png")

The Chrome trace has one track (thread) per coroutine and one complete ("X") event per step item, with
args tokens / view_tokens / kind / priority / step / path (which code ran the step: "fused", "native",
"torch" or "reference"). Times are microseconds from the first step's start.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from cothink.runtime.engine import StepRecord

__all__ = ["chrome_trace", "render_timeline_png", "write_chrome_trace"]

KIND_COLORS = {"extend": "#4C72B0", "generate": "#55A868", "probe": "#DD8452"}
_PID = 1


def _lanes(records: list[StepRecord]) -> dict[str, int]:
    """Coroutine name -> lane number, in order of first appearance."""
    lanes: dict[str, int] = {}
    for record in records:
        for item in record.items:
            lanes.setdefault(item.coroutine, len(lanes) + 1)
    return lanes


def chrome_trace(records: Iterable[StepRecord], process_name: str = "cothink engine") -> dict[str, Any]:
    """The Chrome trace JSON object (``{"traceEvents": [...], ...}``) for `records`."""
    records = list(records)
    lanes = _lanes(records)
    t0 = records[0].start if records else 0.0
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": _PID, "tid": 0, "args": {"name": process_name}},
    ]
    for name, tid in lanes.items():
        events.append({"ph": "M", "name": "thread_name", "pid": _PID, "tid": tid, "args": {"name": name}})
        events.append(
            {"ph": "M", "name": "thread_sort_index", "pid": _PID, "tid": tid, "args": {"sort_index": tid}}
        )
    for record in records:
        ts = (record.start - t0) * 1e6
        dur = max((record.end - record.start) * 1e6, 0.001)
        for item in record.items:
            events.append(
                {
                    "ph": "X",
                    "name": item.kind,
                    "cat": item.kind,
                    "pid": _PID,
                    "tid": lanes[item.coroutine],
                    "ts": round(ts, 3),
                    "dur": round(dur, 3),
                    "args": {
                        "tokens": item.tokens,
                        "view_tokens": item.view_tokens,
                        "kind": item.kind,
                        "priority": item.priority,
                        "step": record.index,
                        "path": record.path,
                        "threads": record.threads,
                        "batch_items": len(record.items),
                    },
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"steps": len(records), "coroutines": len(lanes)},
    }


def write_chrome_trace(records: Iterable[StepRecord], path: str | Path) -> Path:
    """Write a Chrome/Perfetto trace JSON of `records` to `path`; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(records)))
    return path


def render_timeline_png(
    records: Iterable[StepRecord],
    path: str | Path,
    *,
    title: str | None = None,
    max_lanes: int = 48,
) -> Path:
    """Draw one lane per coroutine (x = seconds since the first step), a box per step item, to a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    records = list(records)
    lanes = _lanes(records)
    shown = dict(list(lanes.items())[:max_lanes])
    t0 = records[0].start if records else 0.0
    bars: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for record in records:
        start, width = record.start - t0, max(record.end - record.start, 1e-6)
        for item in record.items:
            if item.coroutine in shown:
                bars.setdefault((item.coroutine, item.kind), []).append((start, width))

    height = 1.2 + 0.38 * max(len(shown), 1)
    fig = Figure(figsize=(12, height), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for (name, kind), spans in bars.items():
        lane = shown[name]
        ax.broken_barh(spans, (lane - 0.4, 0.8), facecolors=KIND_COLORS.get(kind, "#8172B3"), linewidth=0)
    ax.set_yticks(list(shown.values()))
    ax.set_yticklabels([n if len(n) <= 28 else n[:25] + "..." for n in shown])
    ax.set_ylim(0.4, len(shown) + 0.6)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first step")
    end = (records[-1].end - t0) if records else 1.0
    ax.set_xlim(0, max(end, 1e-3))
    ax.grid(axis="x", alpha=0.3)
    hidden = len(lanes) - len(shown)
    steps = len(records)
    ax.set_title(
        title
        or f"cothink step timeline: {steps} steps, {len(lanes)} coroutines"
        + (f" ({hidden} not shown)" if hidden else "")
    )
    kinds = sorted({kind for _, kind in bars})
    if kinds:
        ax.legend(
            handles=[Patch(color=KIND_COLORS.get(k, "#8172B3"), label=k) for k in kinds],
            loc="upper right",
            fontsize="small",
        )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
