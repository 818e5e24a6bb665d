"""`cothink eval <suite>|all`: run the evaluation suites and write a results folder.

Wiring: `cothink.cli` calls `add_parser(subparsers)`; the parser's `func` is `run(args)`.
Also runnable as `python -m cothink.eval ...`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cothink.cli import QUANTIZE_MODES

if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from cothink.eval.common import SuiteResult

# One line per suite, in the report's order: its name and its module (NAME, TITLE, QUESTION, METHOD,
# plan(quick, duration), estimate_s(plan, speed), async run(ctx, plan) -> SuiteResult).
SUITE_MODULES = {
    "sync-cost": "cothink.eval.suites.sync_cost",
    "latency": "cothink.eval.suites.latency",
    "interrupts": "cothink.eval.suites.interrupts",
    "consistency": "cothink.eval.suites.consistency",
    "soak": "cothink.eval.suites.soak",
    "faults": "cothink.eval.suites.faults",
    "cost": "cothink.eval.suites.cost",
}
SUITE_NAMES = tuple(SUITE_MODULES)
DEFAULT_MODELS = "smollm2,qwen35-random"


def _suite_modules() -> dict[str, Any]:
    import importlib

    return {name: importlib.import_module(module) for name, module in SUITE_MODULES.items()}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eval",
        help="run the evaluation suites (sync cost, latency, interrupts, consistency, soak, faults, cost)",
        description="Run evaluation suites comparing cothink with turn-based / text-passing baselines in "
        "the same "
        "process on the same weights, and write a results folder (report.md, PNG plots, raw JSON/CSV, "
        "config.json).",
    )
    p.add_argument("suite", choices=[*SUITE_NAMES, "all"], help="which suite to run, or 'all'")
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes (minutes on a 2-core CPU); the report states where quick mode stops",
    )
    p.add_argument("--out", default=None, help="results folder (default: results/eval-<timestamp>)")
    p.add_argument(
        "--models",
        default=DEFAULT_MODELS,
        help=f"comma-separated models: smollm2, qwen35-random or a local folder (default: {DEFAULT_MODELS})",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="soak duration in seconds per model (default: 30 with --quick, 600 otherwise)",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_argument(
        "--quantize", choices=QUANTIZE_MODES, default=None,
        help="weight-only int8 or 4-bit linears (Llama, Qwen2, Qwen3)",
    )
    p.add_argument(
        "--threads",
        default="auto",
        help="torch threads: a number, or 'auto' (torch's default, but 1 when the machine is already "
        "busy: OpenMP spin-waits make 2 threads on a contended 2-core CPU several times slower)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated inputs")
    p.add_argument(
        "--script",
        default=None,
        metavar="FILE",
        help="a workload script (JSON or YAML: timed start / extend / generate / probe events of named "
        "coroutines) run by the latency suite besides its own workloads; docs/evaluation.md gives the format",
    )
    p.add_argument(
        "--problems",
        default=None,
        metavar="FILE",
        help='a problem set (JSON Lines, one {"question": ..., "answer": ...} a line) solved by the '
        "consistency suite instead of its generated arithmetic problems",
    )
    p.set_defaults(func=run)
    return p


@dataclass(frozen=True)
class Speed:
    """Measured on the loaded model, to estimate the run's duration."""

    prefill_tps: float
    step_s: float


async def _measure_speed(model: Any) -> Speed:
    engine = model.engine(kv_tokens=1024)
    async with engine:
        block = engine.block("calibration")
        ids = model.encode("The plant log records readings from every sensor on the floor. " * 20)[:128]
        t0 = time.perf_counter()
        await engine.extend(block, token_ids=ids, name="calibration")
        prefill = 128 / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        await engine.generate(block, max_tokens=6, stop_at_eos=False, name="calibration").collect()
        step = (time.perf_counter() - t0) / 6
    return Speed(prefill, step)


def _calibrate(model: Any) -> Speed:
    import asyncio

    return asyncio.run(_measure_speed(model))


def _threads(choice: str) -> tuple[int, str]:
    import torch

    if choice != "auto":
        n = int(choice)
        torch.set_num_threads(n)
        return n, "set by --threads"
    default = torch.get_num_threads()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    cpus = os.cpu_count() or 1
    if default > 1 and load >= cpus - 0.5:
        torch.set_num_threads(1)
        return 1, f"auto: 1-minute load average {load:.1f} on {cpus} CPUs, so 1 thread instead of {default}"
    return default, "auto: torch default (machine not busy)"


def _command_line() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith("__main__.py") and "eval" in Path(argv[0]).parts[-2:-1]:
        return shlex.join(["python", "-m", "cothink.eval", *argv[1:]])
    if argv and Path(argv[0]).name == "cothink":
        return shlex.join(["cothink", *argv[1:]])
    return shlex.join(argv)


@dataclass
class _Invocation:
    """What one `cothink eval` call runs and where it writes, resolved from its arguments."""

    args: argparse.Namespace
    console: Console
    modules: dict[str, Any]
    suites: list[str]
    model_keys: list[str]
    out: Path
    plans: dict[str, Any]  # each suite's plan: a frozen record of its knobs


def run(args: argparse.Namespace) -> int:
    import torch

    from cothink.errors import InvalidParameterError
    from cothink.eval import report

    _quiet_libraries()
    t_start = time.perf_counter()
    try:
        inv = _invocation(args)
    except InvalidParameterError as exc:
        print(f"cothink eval: {exc}", file=sys.stderr)
        return 2
    threads, reason = _threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    command = _command_line()
    inv.console.print(
        f"[bold]cothink eval[/bold] {args.suite} ({'quick' if args.quick else 'full'}) on "
        f"{', '.join(inv.model_keys)}; torch threads {threads} ({reason}); results in {inv.out}"
    )
    loaded = _load_and_calibrate(inv, dtype)
    expected = _announce_expected_duration(inv, loaded)

    dtype_label = f"{args.dtype} (int8 weights)" if args.quantize else args.dtype
    config = report.environment(command, threads, reason, dtype_label, loaded)
    config.update(
        quick=args.quick, suites=inv.suites, plans=inv.plans, seed=args.seed, expected_duration_s=expected
    )
    # the folder is written after every suite, so a run cut short keeps what it finished
    results = _run_suites(inv, loaded, lambda done: _write_results(inv, config, done, t_start))
    elapsed = time.perf_counter() - t_start
    _print_outcome(inv, loaded, results, elapsed)
    return 1 if any(r.status == "FAIL" for r in results) else 0


def _quiet_libraries() -> None:
    """Keep the console to the progress bar: library warnings and logs would interleave with it."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:
        pass
    logging.getLogger("cothink").setLevel(logging.ERROR)


def _invocation(args: argparse.Namespace) -> _Invocation:
    """Resolve the arguments (and create the results folder)."""
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:  # a log file: don't wrap at 80 columns
        console = Console(stderr=True, width=160)
    modules = _suite_modules()
    suites = list(SUITE_NAMES) if args.suite == "all" else [args.suite]
    plans = {name: modules[name].plan(args.quick, args.duration) for name in suites}
    plans.update(_user_inputs(args, plans))
    out = Path(args.out) if args.out else Path("results") / time.strftime("eval-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    return _Invocation(
        args=args,
        console=console,
        modules=modules,
        suites=suites,
        model_keys=[m.strip() for m in args.models.split(",") if m.strip()],
        out=out,
        plans=plans,
    )


# The user's files each suite reads: option -> (suite, the plan's field, its loader's module and name).
USER_INPUTS = {
    "script": ("latency", "script", "cothink.eval.script", "load_script"),
    "problems": ("consistency", "problems_file", "cothink.eval.workload", "load_problems"),
}


def _user_inputs(args: argparse.Namespace, plans: dict[str, Any]) -> dict[str, Any]:
    """The plans that read a user's file (--script, --problems), each file validated now, before any
    model loads; InvalidParameterError says what is wrong, or that no suite of this run reads it."""
    import dataclasses
    import importlib

    from cothink.errors import InvalidParameterError

    changed: dict[str, Any] = {}
    for option, (suite, field_name, module, loader) in USER_INPUTS.items():
        path = getattr(args, option, None)
        if path is None:
            continue
        if suite not in plans:
            raise InvalidParameterError(
                f"--{option} is read by the {suite} suite, which this run does not include", param=option
            )
        getattr(importlib.import_module(module), loader)(path)
        changed[suite] = dataclasses.replace(changed.get(suite, plans[suite]), **{field_name: str(path)})
    return changed


def _load_and_calibrate(inv: _Invocation, dtype: torch.dtype) -> list[Any]:
    from cothink.eval import models as model_zoo

    loaded = []
    with inv.console.status("loading models") as status:
        for key in inv.model_keys:
            status.update(f"loading {key}")
            loaded.append(model_zoo.load(key, dtype, quantize=inv.args.quantize))
            status.update(f"calibrating {key}")
            speed = _calibrate(loaded[-1])
            loaded[-1].info["calibration"] = {
                "prefill_tok_s": speed.prefill_tps,
                "decode_step_s": speed.step_s,
            }
    return loaded


def _announce_expected_duration(inv: _Invocation, loaded: list[Any]) -> float:
    """Print each model's calibration and the run's estimated duration (seconds, returned)."""
    expected = 0.0
    for m in loaded:
        speed = Speed(m.info["calibration"]["prefill_tok_s"], m.info["calibration"]["decode_step_s"])
        expected += sum(inv.modules[name].estimate_s(inv.plans[name], speed) for name in inv.suites)
        inv.console.print(
            f"  {m.key}: prefill {speed.prefill_tps:.0f} tok/s, decode step {speed.step_s * 1000:.0f} ms"
        )
    inv.console.print(
        f"[bold]expected duration: about {expected / 60:.1f} min[/bold] "
        f"(estimated from the calibration above; load on the machine changes it)"
    )
    return expected


def _run_suites(
    inv: _Invocation, loaded: list[Any], save: Callable[[list[SuiteResult]], None]
) -> list[SuiteResult]:
    """Every suite on every model, in that order, under one progress bar; `save` gets the results so far
    after each."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    results: list[SuiteResult] = []
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=inv.console,
        transient=False,
    )
    with progress:
        overall = progress.add_task("evaluation", total=len(loaded) * len(inv.suites))
        for m in loaded:
            for name in inv.suites:
                label = f"{m.key} / {name}"
                progress.update(overall, description=label)
                result = _run_suite(
                    inv,
                    m,
                    name,
                    lambda msg, label=label: progress.update(overall, description=f"{label}: {msg}"),
                )
                results.append(result)
                save(results)
                progress.console.print(f"  {label}: [bold]{result.status}[/bold] in {result.elapsed_s:.0f} s")
                progress.advance(overall)
    return results


def _run_suite(inv: _Invocation, model: Any, name: str, say: Callable[[str], None]) -> SuiteResult:
    """One suite on one model; a crash becomes a result carrying the error, so the other suites still run."""
    import asyncio

    from cothink.eval.common import SuiteContext, SuiteResult, plan_params

    args = inv.args
    ctx = SuiteContext(model, args.quick, inv.out, args.duration, seed=args.seed, progress=say)
    plan = inv.plans[name]
    t0 = time.perf_counter()
    try:
        result = asyncio.run(inv.modules[name].run(ctx, plan))
    except Exception as exc:
        result = SuiteResult(name, model.key, params=plan_params(plan))
        result.error = "".join(traceback.format_exception(exc)[-3:]).strip()
    result.elapsed_s = time.perf_counter() - t0
    return result


def _write_results(inv: _Invocation, config: dict, results: list[SuiteResult], t_start: float) -> None:
    """config.json, raw/ and report.md for the results so far (suites not run yet: "not run")."""
    import json

    from cothink.eval import report

    elapsed = time.perf_counter() - t_start
    config["elapsed_s"] = elapsed
    config["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    out = inv.out
    (out / "config.json").write_text(json.dumps(report._jsonable(config), indent=1))
    report.write_raw(out, results)
    (out / "report.md").write_text(report.render(results, config, inv.modules, elapsed_s=elapsed))


def _print_outcome(inv: _Invocation, loaded: list[Any], results: list[SuiteResult], elapsed: float) -> None:
    """A status table (suite x model), then every failed or warned check and every crash."""
    from rich.table import Table as RichTable

    console = inv.console
    table = RichTable(title=f"cothink eval: {elapsed:.0f} s")
    table.add_column("suite")
    for m in loaded:
        table.add_column(m.key)
    for name in inv.suites:
        row = [name]
        for m in loaded:
            r = next(x for x in results if x.suite == name and x.model == m.key)
            colour = {"PASS": "green", "WARN": "yellow", "FAIL": "red"}[r.status]
            row.append(f"[{colour}]{r.status}[/{colour}] ({r.elapsed_s:.0f} s)")
        table.add_row(*row)
    console.print(table)
    for r in results:
        for c in r.checks:
            if c.status in ("FAIL", "WARN"):
                console.print(
                    f"  {r.suite}/{r.model}: {c.status} {c.name}" + (f" ({c.detail})" if c.detail else "")
                )
        if r.error:
            console.print(f"  {r.suite}/{r.model}: crashed: {r.error.splitlines()[-1]}")
    console.print(f"report: {inv.out / 'report.md'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cothink.eval")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "eval":
        argv = ["eval", *argv]
    args = parser.parse_args(argv)
    return args.func(args)
