"""System monitoring: name the anomaly in a live resource stream (`cothink experiment monitor`).

The DevOps-Gym monitoring task shape, run locally (`monitor_sim`): each scenario starts small real
processes, one of which turns anomalous at its onset (or none does). Its observation stream is sampled
with psutil every `--interval` seconds and recorded once (a trace: `traces.jsonl` in the output folder;
`--traces FILE` replays saved ones), so every condition sees the identical stream. The stream is then
delivered to the agent on the engine's clock: one observation every `--passes-per-event` forward
passes, as if the host produced a sample every that many passes. An agent that spends more passes per
observation falls behind: observations pile up, and all but the newest `--backlog` are dropped (seen,
never processed). While the engine is idle (the agent waits for input) the clock jumps to the next
observation: waiting costs nothing.

Conditions:

- `focus-on`, `focus-off`: the Monitor pattern (`cothink.agents.Monitor`) with a background thinker
  (`--think-tokens`) reading the bounded observation window live, and an anomaly probe after every
  observation (P(yes) >= `--threshold` raises a finding; a second probe over the anomaly kinds names
  it); with or without the focus prompt (`FOCUS`).
- `sequential`: the paper's baseline: the same Monitor with the focus prompt and no background thinker
  (`mode="sequential"`): at every observation the watcher first writes `--think-tokens` of reasoning
  about the window, then probes; it reasons over every observation it reads, in turn.
- `turn-based`: text passing: at every observation the whole observation log so far is encoded again
  in a fresh context (system + task + log), then the same two probes decide.
- `rules`: no model: fixed thresholds on the same psutil signals, read from the same observation texts
  (`monitor_rules.RuleEngine`); it never uses the engine, so it never falls behind.

The agent reports the first finding's type (the run stops there), or `none` when the stream ends.

Row per (scenario, condition): `predicted`, `correct`; `forward_passes` (engine passes from the first
observation to the report); `tokens_encoded` (tokens written into memory: prefill + generated);
`events_seen` (observations that became due before the report) and `events_processed` (those the agent
read); `detect_seconds` (scenario time of the newest due observation at the report minus the onset;
null when the report is `none`, negative for a report before the onset); `read_seconds` (the same for the
newest observation the agent had read at the report). A report is correct when it names the anomaly
from a sample taken at or after its onset (`none` for a `none` scenario): a finding that read only
samples from before the onset is a false alarm whatever type it names.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cothink.experiments import harness
from cothink.experiments.harness import ExperimentConfig, Results, Row
from cothink.experiments.monitor_sim import (
    ANOMALIES,
    MonitorScenario,
    Simulation,
    Trace,
    builtin_scenarios,
    load_scenarios,
    load_traces,
    save_traces,
)

NAME = "monitor"
log = logging.getLogger("cothink.experiments.monitor")
CONDITIONS = ("focus-on", "focus-off", "sequential", "turn-based", "rules")
FOCUS_CONDITIONS = ("focus-on", "focus-off")  # the ones `--focus` selects among
KINDS = tuple(a for a in ANOMALIES if a != "none")
SYSTEM = "You are a site reliability engineer watching a live stream of process resource samples."
TASK = (
    "Every second you get one sample per process (name[pid], resident memory rss, open file descriptors "
    "fds, threads thr, CPU percent, read/write KB per second, IO operations per second) and a system line "
    "with totals and the disk usage of the service's data folder. Normal services fluctuate a little. "
    "Report an anomaly when one process keeps growing or stays abnormally high."
)
FOCUS = (
    "Only compare each process with its own earlier samples: memory, fds, threads, CPU, IO and disk. "
    "Ignore everything else and do not speculate about causes. Answer as soon as one metric of one process "
    "keeps rising or stays far above its normal level."
)
QUESTION = "Is one process anomalous right now? Answer Yes or No."


class MonitorConfig(ExperimentConfig):
    conditions: list[str]
    scenarios: list[str]  # ids
    interval_s: float
    passes_per_event: int
    backlog: int
    think_tokens: int
    threshold: float
    window_tokens: int
    traces_file: str


class MonitorRow(Row):
    scenario: str
    anomaly: str
    condition: str
    predicted: str
    correct: bool
    forward_passes: int
    tokens_encoded: int
    events_seen: int
    events_processed: int
    detect_seconds: float | None
    # scenario time of the newest observation the agent had read at its report, minus the onset (null for
    # `none`; rows saved before it existed have none): below 0, the finding read no anomalous sample
    read_seconds: float | None = None


# ------------------------------------------------------------------------------------- the clock


@dataclass
class PacedStream:
    """A recorded observation stream delivered on the engine's pass clock.

    Observation i is due `passes_per_event` passes after observation i-1; when the engine has no work
    while the consumer waits, the clock jumps to the next due observation. `events_seen` counts the
    observations that became due, `events_processed` those handed out; older ones beyond `backlog`
    are dropped when the consumer is late."""

    engine: Any
    trace: Trace
    passes_per_event: int
    backlog: int = 2
    passes: int = 0  # engine passes since the stream started
    skipped: int = 0  # passes the clock jumped over while the engine was idle
    events_processed: int = 0
    events_dropped: int = 0
    _next: int = 0  # next observation not yet handed out or dropped
    last_index: int = -1  # the observation handed out last
    _started: bool = False
    texts: list[str] = field(default_factory=list)  # what was handed out

    def on_step(self, record: Any) -> None:
        if self._started:
            self.passes += 1

    @property
    def clock(self) -> int:
        return self.passes + self.skipped

    def due(self) -> int:
        """How many observations are due by now (observation 0 is due at once)."""
        return min(len(self.trace.observations), self.clock // self.passes_per_event + 1)

    @property
    def events_seen(self) -> int:
        return self.due()

    def _idle(self) -> bool:
        occ = self.engine.occupancy()
        return occ.works == 0

    def time_at(self, clock: int) -> float:
        """Scenario time of the newest observation due at stream clock `clock`."""
        obs = self.trace.observations
        return obs[min(len(obs) - 1, clock // self.passes_per_event)].t

    async def __aiter__(self) -> AsyncIterator[str]:
        self._started = True
        total = len(self.trace.observations)
        while self._next < total:
            due = self.due()
            if self._next < due:
                if due - self._next > self.backlog:  # late: only the newest `backlog` are worth reading
                    self.events_dropped += due - self.backlog - self._next
                    self._next = due - self.backlog
                text = self.trace.observations[self._next].text()
                self.last_index = self._next
                self._next += 1
                self.events_processed += 1
                self.texts.append(text)
                yield text
                continue
            # nothing due: let the engine run its next pass, or jump the clock when it has no work
            if self._idle():
                await asyncio.sleep(0)  # give a coroutine about to submit work its chance first
                if self._next >= self.due() and self._idle():
                    self.skipped += self._next * self.passes_per_event - self.clock
                continue
            await asyncio.sleep(0.001)


# ------------------------------------------------------------------------------------- conditions


@dataclass(frozen=True)
class Report:
    predicted: str
    at_passes: int | None  # stream clock at the report (None: no finding)


@dataclass
class ProbeLog:
    """P(anomaly) of every anomaly probe, with the scenario time of the newest observation it read:
    written to `probes.jsonl` (the threshold's headroom: how far each condition's answers move)."""

    entries: list[dict[str, Any]] = field(default_factory=list)

    def note(self, trace: Trace, stream: PacedStream, condition: str, p_yes: float) -> None:
        t = trace.observations[stream.last_index].t if stream.last_index >= 0 else 0.0
        self.entries.append({"scenario": trace.scenario.id, "anomaly": trace.scenario.anomaly,
                             "onset_s": trace.scenario.onset_s, "condition": condition, "t": t,
                             "p_yes": round(p_yes, 5)})


async def run_monitor_pattern(
    engine: Any, stream: PacedStream, focus: bool, config: MonitorConfig, seed: int,
    on_probe: Callable[[float], None] = lambda p: None,
    mode: Literal["async", "sequential"] = "async",
) -> Report:
    """The Monitor pattern: a background thinker beside the probes (`async`), or reasoning written
    before the probe at every observation (`sequential`)."""
    from cothink.agents.monitor import Monitor

    agent = Monitor(
        engine,
        task=TASK,
        kinds=KINDS,
        focus=FOCUS if focus else None,
        question=QUESTION,
        threshold=config.threshold,
        window_tokens=config.window_tokens,
        chunk_tokens=min(256, config.window_tokens),
        think_tokens=config.think_tokens,
        mode=mode,
        stop_on_finding=True,
        system=SYSTEM,
        seed=seed,
        on_event=lambda e: on_probe(e.value) if e.kind == "probe" and e.value is not None else None,
    )
    result = await agent.run(stream)
    if result.findings:
        return Report(result.findings[0].type, stream.clock)
    return Report("none", None)


async def run_turn_based(
    engine: Any,
    stream: PacedStream,
    config: MonitorConfig,
    on_probe: Callable[[float], None] = lambda p: None,
) -> Report:
    """Text passing: every observation re-encodes the whole log in a fresh context, then probes."""
    from cothink.agents.chat import ChatFormat

    chat = ChatFormat(engine.tokenizer)
    log: list[str] = []
    async for text in stream:
        log.append(text)
        block = engine.block("turn-based")
        try:
            prompt = chat.conversation(
                [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": TASK + "\n\n" + "\n".join(log)},
                ]
            )
            await engine.extend(block, prompt, name="turn-based", priority="interactive")
            p = await engine.probe([block], chat.question(QUESTION), ("Yes", "No"), name="turn-based")
            on_probe(p["Yes"])
            if p["Yes"] >= config.threshold:
                kinds = await engine.probe(
                    [block],
                    chat.question(f"Which anomaly is it? One of: {', '.join(KINDS)}."),
                    KINDS,
                    name="turn-based",
                )
                return Report(max(kinds, key=kinds.__getitem__), stream.clock)
        finally:
            engine.release(block)
    return Report("none", None)


async def run_rules(stream: PacedStream) -> Report:
    """The rule engine over the same observation texts (no model: the stream's clock never moves)."""
    from cothink.experiments.monitor_rules import RuleEngine

    rules = RuleEngine()
    async for text in stream:
        finding = rules.observe(text)
        if finding is not None:
            return Report(finding.anomaly, stream.clock)
    return Report("none", None)


async def run_condition(
    handle: Any, trace: Trace, condition: str, config: MonitorConfig, seed: int,
    probes: ProbeLog | None = None,
) -> MonitorRow:
    engine = handle.engine(kv_tokens=16384)
    async with engine:
        stream = PacedStream(engine, trace, config.passes_per_event, config.backlog)
        engine.step_listeners.append(stream.on_step)

        def on_probe(p: float) -> None:
            if probes is not None:
                probes.note(trace, stream, condition, p)

        if condition == "turn-based":
            report = await run_turn_based(engine, stream, config, on_probe)
        elif condition == "rules":
            report = await run_rules(stream)
        elif condition == "sequential":
            report = await run_monitor_pattern(engine, stream, True, config, seed, on_probe, "sequential")
        else:
            focus = condition == "focus-on"
            report = await run_monitor_pattern(engine, stream, focus, config, seed, on_probe)
        tokens = sum(s.tokens_written for s in engine.stats.values())
    sc = trace.scenario
    detect = read = None
    if report.predicted != "none" and report.at_passes is not None:
        detect = round(stream.time_at(report.at_passes) - sc.onset_s, 2)
        read = round(trace.observations[max(0, stream.last_index)].t - sc.onset_s, 2)
    return MonitorRow(
        scenario=sc.id,
        anomaly=sc.anomaly,
        condition=condition,
        predicted=report.predicted,
        correct=is_correct(sc.anomaly, report.predicted, read),
        forward_passes=stream.passes,
        tokens_encoded=tokens,
        events_seen=stream.events_seen,
        events_processed=stream.events_processed,
        detect_seconds=detect,
        read_seconds=read,
    )


def is_correct(anomaly: str, predicted: str, read_seconds: float | None) -> bool:
    """The right type, from a sample taken at or after the onset: a finding whose newest read sample
    predates the anomaly saw nothing anomalous, so it is a false alarm whatever type it happened to name
    (even when, because the agent ran late, the report itself came after the onset)."""
    if predicted != anomaly:
        return False
    return anomaly == "none" or (read_seconds is not None and read_seconds >= 0)


def is_false_alarm(row: MonitorRow) -> bool:
    """A finding where there was nothing yet: in a `none` scenario, or read from samples before the onset."""
    if row.predicted == "none":
        return False
    return row.anomaly == "none" or (row.read_seconds is not None and row.read_seconds < 0)


# ------------------------------------------------------------------------------------------ traces


async def record_all(
    scenarios: Sequence[MonitorScenario], interval_s: float, parallel: int = 4
) -> list[Trace]:
    """Record scenarios live, `parallel` at a time (their processes are light and mostly sleep)."""

    async def one(sc: MonitorScenario) -> Trace:
        with Simulation(sc, interval_s) as sim:
            observations = [o async for o in sim.stream()]
            return Trace(sc, interval_s, observations, sim.pids)

    traces: list[Trace] = []
    for i in range(0, len(scenarios), parallel):
        traces += await asyncio.gather(*(one(sc) for sc in scenarios[i : i + parallel]))
    return traces


# ----------------------------------------------------------------------------------------- summary


def summarize(rows: Sequence[MonitorRow]) -> dict[str, Any]:
    """summary[condition] = {n, correct, accuracy, accuracy_ci95 (Wilson), false_alarms, forward_passes,
    tokens_encoded, processed_share, detect_seconds}
    plus summary["by_anomaly"][condition][anomaly] = accuracy."""
    out: dict[str, Any] = {}
    for cond in dict.fromkeys(r.condition for r in rows):
        rs = [r for r in rows if r.condition == cond]
        detects = [r.detect_seconds for r in rs if r.correct and r.detect_seconds is not None]
        correct = sum(r.correct for r in rs)
        out[cond] = {
            "n": len(rs),
            "correct": correct,
            "accuracy": correct / len(rs),
            "accuracy_ci95": harness.proportion_ci(correct, len(rs)),
            "false_alarms": sum(is_false_alarm(r) for r in rs),
            "forward_passes": statistics.fmean(r.forward_passes for r in rs),
            "forward_passes_total": sum(r.forward_passes for r in rs),
            "tokens_encoded": statistics.fmean(r.tokens_encoded for r in rs),
            "processed_share": (sum(r.events_processed for r in rs) / max(1, sum(r.events_seen for r in rs))),
            "detect_seconds": statistics.fmean(detects) if detects else None,
        }
    out["by_anomaly"] = {
        cond: {
            a: sum(r.correct for r in rows if r.condition == cond and r.anomaly == a)
            / max(1, sum(1 for r in rows if r.condition == cond and r.anomaly == a))
            for a in dict.fromkeys(r.anomaly for r in rows)
        }
        for cond in dict.fromkeys(r.condition for r in rows)
    }
    return out


SWEEP_THRESHOLDS = (0.7, 0.75, 0.8, 0.85, 0.9, 0.95)


def threshold_sweep(
    probes: Sequence[dict[str, Any]], thresholds: Sequence[float] = SWEEP_THRESHOLDS
) -> dict[str, dict[float, tuple[int, int]]]:
    """sweep[condition][threshold] = (detections, false alarms) of the anomaly probe alone: in each
    (scenario, condition), the first probe with P(yes) >= threshold is a detection when it read a sample at
    or after the onset of an anomalous scenario, a false alarm otherwise (the type probe is not counted).
    Exact for thresholds up to the run's own: a run stops at its first finding, so later probes are
    missing; a calibration run with a threshold above 1 probes every observation to the end."""
    curves: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for e in probes:
        curves.setdefault((e["condition"], e["scenario"]), []).append(e)
    out: dict[str, dict[float, tuple[int, int]]] = {}
    for (cond, _), entries in curves.items():
        by = out.setdefault(cond, {th: (0, 0) for th in thresholds})
        for th in thresholds:
            hit = next((e for e in entries if e["p_yes"] >= th), None)
            if hit is None:
                continue
            det, fa = by[th]
            early = hit["anomaly"] == "none" or hit["t"] < hit["onset_s"]
            by[th] = (det, fa + 1) if early else (det + 1, fa)
    return out


def _sweep_lines(out: Path, threshold: float) -> list[str]:
    thresholds = [th for th in SWEEP_THRESHOLDS if th <= threshold]
    sweep = threshold_sweep(_saved_probes(out), thresholds)
    if not sweep or not thresholds:
        return []
    why = ("no finding was raised (threshold above 1), so every probe ran to the end of the stream"
           if threshold > 1 else "exact up to this run's threshold: the run stopped at its first finding")
    return [
        "Anomaly probe alone at other thresholds (`probes.jsonl`; detections / false alarms of the first "
        f"probe at or above each threshold; {why}):",
        "",
        harness.markdown_table(
            ["condition", *(f"{th:g}" for th in thresholds)],
            [[c, *(f"{by[th][0]} / {by[th][1]}" for th in thresholds)] for c, by in sweep.items()],
        ),
        "",
    ]


COLORS = {"focus-on": "tab:blue", "focus-off": "tab:orange", "sequential": "tab:green",
          "turn-based": "tab:gray", "rules": "tab:purple"}


def plot(path: Path, summary: dict[str, Any]) -> Path:
    """Accuracy, forward passes per task and share of events processed, a bar per condition."""
    conds = [c for c in summary if c != "by_anomaly"]
    panels = (
        ("accuracy", "accuracy"),
        ("forward_passes", "forward passes / task"),
        ("processed_share", "share of events processed"),
    )
    with harness.figure(path, len(panels), width=5.0) as axes:
        for ax, (key, label) in zip(axes, panels):
            ax.bar(
                conds,
                [summary[c][key] for c in conds],
                color=[COLORS.get(c, "tab:gray") for c in conds],
            )
            ax.set_title(label)
            ax.grid(alpha=0.3, axis="y")
    return path


def report(results: Results[MonitorConfig, MonitorRow], out: Path | None = None) -> str:
    c, s = results.config, results.summary
    conds = [k for k in s if k != "by_anomaly"]
    anomalies = list(dict.fromkeys(r.anomaly for r in results.rows))
    lines = [
        "# System monitoring: accuracy and cost",
        "",
        f"Model: {c.model_description or c.model} ({c.dtype}); {len(c.scenarios)} scenarios; one observation "
        f"every {c.interval_s} s of scenario time, delivered every {c.passes_per_event} forward passes "
        f"(backlog {c.backlog}); thinker {c.think_tokens} tokens; threshold {c.threshold}. "
        f"Machine: {harness.machine_line(c.machine)}; wall {c.wall_s:.0f} s.",
        *filter(None, ["", harness.parts_line(c, "tasks")]),
        "",
        harness.markdown_table(
            [
                "condition",
                "correct (share, 95% CI)",
                "false alarms",
                "forward passes / task",
                "total passes",
                "tokens encoded / task",
                "events processed / seen",
                "detect s (correct)",
            ],
            [
                [
                    k,
                    harness.format_proportion(s[k]["correct"], s[k]["n"]),
                    s[k]["false_alarms"],
                    s[k]["forward_passes"],
                    s[k]["forward_passes_total"],
                    s[k]["tokens_encoded"],
                    s[k]["processed_share"],
                    s[k]["detect_seconds"],
                ]
                for k in conds
            ],
        ),
        "",
        "A report is correct when it names the scenario's anomaly (or `none` for a `none` scenario) having "
        "read a sample taken at or after the onset; a finding that read only earlier samples, or one in a "
        "`none` scenario, is a false alarm.",
        "",
        "Accuracy per anomaly:",
        "",
        harness.markdown_table(
            ["condition", *anomalies], [[k, *(s["by_anomaly"][k][a] for a in anomalies)] for k in conds]
        ),
        "",
        *(_sweep_lines(out, c.threshold) if out is not None else []),
        "![monitor](monitor.png)",
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- CLI


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=list(CONDITIONS))
    p.add_argument(
        "--focus",
        choices=("on", "off", "both"),
        default="both",
        help="which focus conditions to run (the baselines run unless --conditions says)",
    )
    p.add_argument(
        "--scenarios",
        type=Path,
        default=None,
        help="JSONL scenario file ({id, anomaly, onset_s, duration_s, params}); default: built-in set",
    )
    p.add_argument(
        "--per-anomaly", type=int, default=3, help="built-in set: scenarios per anomaly (default 3)"
    )
    p.add_argument(
        "--duration", type=float, default=20.0, help="built-in set: seconds per scenario (default 20)"
    )
    p.add_argument("--only", nargs="+", default=None, metavar="ID", help="run only these scenario ids")
    p.add_argument("--max-events", type=int, default=None,
                   help="replayed traces: deliver only their first N observations")
    p.add_argument(
        "--traces", type=Path, default=None, help="replay recorded traces (JSONL) instead of recording"
    )
    p.add_argument("--interval", type=float, default=1.0, help="sampling interval in seconds (default 1)")
    p.add_argument(
        "--passes-per-event",
        type=int,
        default=8,
        help="forward passes between two observations of the stream (default 8)",
    )
    p.add_argument(
        "--backlog", type=int, default=2, help="observations kept when the agent is late (default 2)"
    )
    p.add_argument(
        "--think-tokens",
        type=int,
        default=64,
        help="background thinker's bounded notes; sequential: reasoning per observation (default 64)",
    )
    p.add_argument(
        "--threshold", type=float, default=0.7, help="P(anomaly) that raises a finding (default 0.7)"
    )
    p.add_argument("--window-tokens", type=int, default=1024, help="observation window bound (default 1024)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run saved in OUT: keep its finished tasks, run the rest on the same streams "
        "(its traces.jsonl unless --traces) and settings",
    )


def _conditions(args: argparse.Namespace) -> list[str]:
    wanted = {"on": {"focus-on"}, "off": {"focus-off"}, "both": {"focus-on", "focus-off"}}[args.focus]
    return [c for c in args.conditions if c not in FOCUS_CONDITIONS or c in wanted]


def load_inputs(args: argparse.Namespace) -> tuple[list[MonitorScenario], list[Trace] | None]:
    if args.traces is not None:
        traces = load_traces(args.traces)
        if args.only:
            traces = [t for t in traces if t.scenario.id in set(args.only)]
        traces = traces[: args.limit] if args.limit else traces
        if args.max_events:
            for t in traces:
                t.observations = t.observations[: args.max_events]
        return [t.scenario for t in traces], traces
    if args.scenarios is not None:
        scenarios = load_scenarios(args.scenarios)
    elif args.quick:
        scenarios = [
            MonitorScenario(
                id="memory_leak-q",
                anomaly="memory_leak",
                onset_s=1.0,
                duration_s=3.0,
                params={"rate_mb_s": 8.0},
            ),
            MonitorScenario(id="none-q", anomaly="none", onset_s=1.0, duration_s=3.0),
        ]
    else:
        scenarios = builtin_scenarios(args.per_anomaly, args.duration)
    if args.only:
        scenarios = [s for s in scenarios if s.id in set(args.only)]
    if args.limit:
        scenarios = scenarios[: args.limit]
    return scenarios, None


def run_experiment(
    config: MonitorConfig,
    scenarios: Sequence[MonitorScenario],
    traces: list[Trace] | None,
    out: Path,
    *,
    show_progress: bool | None = None,
    resume: bool = False,
) -> Results[MonitorConfig, MonitorRow]:
    """Every (scenario, condition) task, one after another; with `resume`, only those the run saved in
    `out` has not finished (same streams and settings required)."""
    t0 = harness.begin(config)
    out.mkdir(parents=True, exist_ok=True)
    if traces is None and resume and (out / "traces.jsonl").exists():  # the streams the saved run recorded
        traces = load_traces(out / "traces.jsonl")
        config.traces_file = str(out / "traces.jsonl")
    if traces is None:
        traces = asyncio.run(record_all(scenarios, config.interval_s))
        save_traces(traces, out / "traces.jsonl")
        config.traces_file = str(out / "traces.jsonl")
    config.scenarios = [t.scenario.id for t in traces]
    rows: list[MonitorRow] = []
    if resume:
        rows = harness.resume(out, config, MonitorRow, unit=_task, rows_per_unit=1, same=RESULT_FIELDS)
    done = {_task(r) for r in rows}
    probes = ProbeLog([e for e in _saved_probes(out) if f"{e['scenario']}|{e['condition']}" in done])
    handle = harness.load_model(config.model, config.dtype)
    config.model_description = handle.description
    # round-robin over anomaly types: a run cut short still covers every type about equally
    order = sorted(range(len(traces)), key=lambda i: (sum(t.scenario.anomaly == traces[i].scenario.anomaly
                                                          for t in traces[:i]), i))
    jobs = [(traces[i], c) for i in order for c in config.conditions
            if f"{traces[i].scenario.id}|{c}" not in done]
    with harness.progress(len(jobs), "monitor tasks", enabled=show_progress) as advance:
        for trace, condition in jobs:
            rows.append(asyncio.run(run_condition(handle, trace, condition, config, config.seed, probes)))
            (out / "probes.jsonl").write_text("".join(json.dumps(e) + "\n" for e in probes.entries))
            advance(1)
            log.info("%d/%d %s", len(rows), len(jobs), rows[-1].model_dump_json())
            config.wall_s = time.perf_counter() - t0
            save(out, config, rows, final=False)
    config.wall_s = time.perf_counter() - t0
    return save(out, config, rows, final=True)


# the config fields that change what a task measures: a resumed run must keep them
RESULT_FIELDS = (
    "model", "dtype", "seed", "quick", "max_tokens", "conditions", "scenarios", "interval_s",
    "passes_per_event", "backlog", "think_tokens", "threshold", "window_tokens",
)


def _task(row: MonitorRow) -> str:
    return f"{row.scenario}|{row.condition}"


def _saved_probes(out: Path) -> list[dict[str, Any]]:
    path = out / "probes.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


FOLDER = harness.ResultsFolder(
    MonitorConfig, MonitorRow, summarize, report, plot, "monitor.png"
)
save = FOLDER.save  # results.json + report.md (after every task), the plot at the end
render = FOLDER.render  # redo summary, report and plot from a saved results.json


def build_config(args: argparse.Namespace) -> MonitorConfig:
    quick = bool(args.quick)
    return MonitorConfig(
        experiment=NAME,
        model=args.model,
        dtype=args.dtype,
        seed=args.seed,
        limit=args.limit,
        quick=quick,
        max_tokens=args.max_tokens,
        threads=args.threads,
        conditions=_conditions(args),
        scenarios=[],
        interval_s=0.5 if quick else args.interval,
        passes_per_event=args.passes_per_event,
        backlog=args.backlog,
        think_tokens=min(args.think_tokens, 8) if quick else args.think_tokens,
        threshold=args.threshold,
        window_tokens=args.window_tokens,
        traces_file=str(args.traces or ""),
    )


def run(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    scenarios, traces = load_inputs(args)
    results = run_experiment(build_config(args), scenarios, traces, args.out, show_progress=args.progress,
                             resume=args.resume)
    print(report(results))
    print(f"results: {args.out / 'results.json'}")
    return 0


EXPERIMENT = harness.Experiment(
    name=NAME,
    help="system monitoring: name the anomaly in a live process stream (async monitor vs baselines)",
    description=__doc__.split("\n\n")[0] if __doc__ else "",
    configure=configure,
    run=run,
    default_max_tokens=64,
)
