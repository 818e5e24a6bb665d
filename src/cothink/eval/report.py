"""The results folder: report.md (tables), raw measurements (JSON, CSV), config.json."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any

from cothink.eval.common import SuiteResult, Table
from cothink.run_info import cpu_model, run_info

# The seven sections, in the framework's order: (suite name, section title). Every report has all seven.
SECTIONS = (
    ("sync-cost", "1. Communication cost per sync"),
    ("latency", "2. Streaming latency and jitter under concurrency"),
    ("interrupts", "3. Interruption and recovery"),
    ("consistency", "4. Output consistency under interleaving"),
    ("soak", "5. Long-run stability"),
    ("faults", "6. Fault injection"),
    ("cost", "7. Cost per unit of output"),
)


def _jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def environment(args_command: str, threads: int, thread_reason: str, dtype: str, models: list[Any]) -> dict:
    import psutil
    import torch
    import transformers

    try:
        from importlib.metadata import version

        cothink_version = version("cothink")
    except Exception:
        from cothink import __version__ as cothink_version
    load = os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3
    return {
        "command": args_command,
        "argv": sys.argv,
        "models": [
            {
                "name": m.key,
                "description": m.description,
                "folder": str(m.folder),
                **m.info,
                "load_s": m.load_s,
            }
            for m in models
        ],
        "dtype": dtype,
        "torch_threads": threads,
        "torch_threads_reason": thread_reason,
        "versions": {
            "cothink": cothink_version,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "machine": {"platform": platform.platform(), "machine": platform.machine(), "node": platform.node()},
        "load_average_at_start": list(load),
        # the commit, CPU and versions every results folder records (cothink.run_info)
        "run": run_info().as_dict(),
    }


def write_raw(out: Path, results: list[SuiteResult]) -> list[Path]:
    """raw/<suite>-<model>.json (the whole result) and raw/<suite>-<model>.csv (one row per measurement)."""
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in results:
        stem = f"{r.suite}-{r.model}"
        p = raw / f"{stem}.json"
        p.write_text(json.dumps(_jsonable(r), indent=1))
        paths.append(p)
        if r.records:
            keys: list[str] = []
            for rec in r.records:
                for k in rec:
                    if k not in keys:
                        keys.append(k)
            p = raw / f"{stem}.csv"
            with p.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=keys)
                w.writeheader()
                for rec in r.records:
                    w.writerow(
                        {
                            k: json.dumps(_jsonable(v)) if isinstance(v, (list, dict)) else v
                            for k, v in rec.items()
                        }
                    )
            paths.append(p)
    (out / "results.json").write_text(json.dumps(_jsonable(results), indent=1))
    return paths


def _md_table(t: Table) -> str:
    def cell(x: Any) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")

    lines = [
        f"**{t.title}**",
        "",
        "| " + " | ".join(cell(c) for c in t.columns) + " |",
        "|" + "|".join("---" for _ in t.columns) + "|",
    ]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in t.rows]
    if t.note:
        lines += ["", f"_{t.note}_"]
    return "\n".join(lines)


def _commit(run: dict[str, Any]) -> str:
    return run["commit"][:12] + (" (uncommitted changes)" if run.get("dirty") else "")


def render(
    results: list[SuiteResult],
    config: dict,
    suites: dict[str, Any],
    *,
    elapsed_s: float,
    plot_prefix: str = "",
) -> str:
    """The Markdown report. `suites` maps suite names to their modules (for QUESTION and METHOD)."""
    out = ["# cothink evaluation report", ""]
    out += [f"Command: `{config['command']}`", ""]
    out += [
        f"Total time: {elapsed_s:.0f} s. "
        f"Mode: {'quick' if config.get('quick') else 'full'}. dtype {config['dtype']}, torch threads "
        f"{config['torch_threads']} ({config['torch_threads_reason']}). CPU: {config['cpu_model']} "
        f"({config['cpu_count']} logical CPUs, {config['memory_gib']} GiB). torch "
        f"{config['versions']['torch']}, "
        f"transformers {config['versions']['transformers']}, cothink {config['versions']['cothink']}"
        + (f" at commit {_commit(config['run'])}" if config.get("run") else "")
        + ". "
        f"Load average at start: {', '.join(f'{x:.2f}' for x in config['load_average_at_start'])}"
        + (
            f"; at end: {', '.join(f'{x:.2f}' for x in config['load_average_at_end'])}"
            if config.get("load_average_at_end")
            else ""
        )
        + ".",
        "",
    ]
    out += ["Models:", ""]
    for m in config["models"]:
        out.append(f"- **{m['name']}**: {m['description']} ({m['parameters'] / 1e6:.1f} M parameters).")
    out += [
        "",
        "Every comparison runs in the same process, on the same weights and dtype. Timings are wall-clock on "
        "this machine and move with its load; token and forward-pass counts do not.",
        "",
    ]
    # summary
    models = list(dict.fromkeys(r.model for r in results))
    out += ["## Summary", "", "| suite | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
    for suite, title in SECTIONS:
        cells = []
        for m in models:
            r = next((x for x in results if x.suite == suite and x.model == m), None)
            cells.append("not run" if r is None else f"{r.status} ({r.elapsed_s:.0f} s)")
        out.append(f"| {title} | " + " | ".join(cells) + " |")
    out += [
        "",
        "PASS: every check holds. WARN: a finding that is not a red line (see the check). FAIL: a red line "
        "was crossed, a percentile it compares had too few samples, or the suite crashed. Checks marked "
        "(timing) compare measured times and move with the machine's load; the others count tokens, steps "
        "and outcomes and hold or fail the same on any machine.",
        "",
    ]
    out += ["### Headline numbers", ""]
    for suite, title in SECTIONS:
        for r in (x for x in results if x.suite == suite):
            line = r.summary or (f"crashed: {r.error.splitlines()[-1]}" if r.error else "")
            if line:
                out.append(f"- **{suite} / {r.model}** ({r.status}): {line}")
    out.append("")
    problems = [(r, c) for r in results for c in r.checks if c.status in ("FAIL", "WARN")]
    if problems:
        out += ["### Failures and warnings", ""]
        out += [
            f"- **{c.status}** {r.suite} / {r.model}: {c.name}" + (f" ({c.detail})" if c.detail else "")
            for r, c in problems
        ]
        out.append("")
    for suite, title in SECTIONS:
        mod = suites.get(suite)
        out += [f"## {title} (`{suite}`)", ""]
        if mod is not None:
            out += [f"**Question.** {mod.QUESTION}", "", f"**Method.** {mod.METHOD}", ""]
        mine = [r for r in results if r.suite == suite]
        if not mine:
            out += ["_Not run in this invocation._", ""]
            continue
        for r in mine:
            out += [f"### {suite} on {r.model}: {r.status}", ""]
            if r.error:
                out += ["```", r.error, "```", ""]
            if r.conditions:
                out += ["Holds under these conditions:", ""] + [f"- {c}" for c in r.conditions] + [""]
            for t in r.tables:
                out += [_md_table(t), ""]
            for p in r.plots:
                out += [f"![{suite} {r.model}]({plot_prefix}{p})", ""]
            if r.checks:
                out += ["Checks:", ""]
                out += [
                    f"- **{c.status}** {c.name}"
                    + (" (timing)" if c.timing else "")
                    + (f": {c.detail}" if c.detail else "")
                    for c in r.checks
                ]
                out.append("")
            for n in r.notes:
                out += [f"Note: {n}", ""]
            out += [f"_Suite time: {r.elapsed_s:.1f} s._", ""]
    return "\n".join(out)
