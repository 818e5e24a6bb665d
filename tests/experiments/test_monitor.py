"""Monitoring experiment: the anomaly simulator (real processes, capped, always cleaned up), the scenario
file format, the pass-paced stream, and a --quick run on a tiny model."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from cothink.experiments import harness
from cothink.experiments import monitor as mon
from cothink.experiments.monitor_sim import (
    ANOMALIES,
    MonitorScenario,
    Observation,
    ProcessCaps,
    ProcessSample,
    Simulation,
    Trace,
    builtin_scenarios,
    load_scenarios,
    save_scenarios,
)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for whoever inherited it to reap it no longer runs)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _our_fds() -> int:
    return psutil.Process().num_fds()


async def _run_all(scenarios: list[MonitorScenario]) -> list[tuple[Simulation, list[Observation], Path]]:
    async def one(sc: MonitorScenario):
        with Simulation(sc, interval_s=0.25) as sim:
            sandbox = sim.sandbox
            obs = [o async for o in sim.stream()]
        return sim, obs, sandbox

    return await asyncio.gather(*(one(sc) for sc in scenarios))


def test_every_anomaly_shows_and_nothing_is_left_behind():
    before_children, before_fds = _children(), _our_fds()
    # rates high enough to show within a few tenths of a second of writing: on a loaded 2-core machine
    # the workers (8 simulations, 32 processes) can start a second late against the sampler's clock
    # (at 4 MB/s a disk fill can show as little as 1.3 MB by the last sample)
    scenarios = [MonitorScenario(id=f"t-{a}", anomaly=a, onset_s=0.3, duration_s=1.5,
                                 params={"memory_leak": {"rate_mb_s": 16}, "fd_leak": {"rate_per_s": 60},
                                         "thread_explosion": {"rate_per_s": 100},
                                         "disk_fill": {"rate_mb_s": 16}}.get(a, {}))
                 for a in ANOMALIES]
    results = asyncio.run(_run_all(scenarios))
    by = {sim.scenario.anomaly: (sim, obs) for sim, obs, _ in results}

    def last(anomaly: str) -> ProcessSample:
        sim, obs = by[anomaly]
        return next(p for p in obs[-1].processes if p.name == sim.scenario.service)

    def first(anomaly: str) -> ProcessSample:
        sim, obs = by[anomaly]
        return next(p for p in obs[0].processes if p.name == sim.scenario.service)

    assert last("memory_leak").rss_mb > first("memory_leak").rss_mb + 8
    assert last("fd_leak").fds > first("fd_leak").fds + 30
    assert last("thread_explosion").threads > first("thread_explosion").threads + 20
    assert by["disk_fill"][1][-1].disk_mb > 2
    assert last("io_slow").io_ops_s > 50
    assert max(p.cpu_pct for o in by["cpu_spike"][1] for p in o.processes if p.name == by["cpu_spike"][0]
               .scenario.service) > 15
    # the healthy service opens its log now and then (one file, briefly): its fd count may blip by one
    # in a sample, but never grows
    none_sim, none_obs = by["none"]
    none_fds = [p.fds for o in none_obs for p in o.processes if p.name == none_sim.scenario.service]
    assert max(none_fds) <= min(none_fds) + 1 and last("none").threads == 1
    for sim, obs, sandbox in results:
        assert len(obs) == 6 and [o.index for o in obs] == list(range(1, 7))
        assert len(obs[0].processes) == 4  # web, cron, cache + the service
        assert not sandbox.exists()
        assert not any(_alive(pid) for pid in sim.pids.values())
    assert _children() == before_children
    assert _our_fds() == before_fds


def test_processes_are_capped_and_in_their_own_group():
    sc = MonitorScenario(id="caps", anomaly="memory_leak", onset_s=0.0, duration_s=3,
                         params={"rate_mb_s": 400, "cap_mb": 10_000})  # asks for far more than the ceiling
    caps = ProcessCaps()
    with Simulation(sc, interval_s=0.5, caps=caps) as sim:
        pid = sim.pids[sc.service]
        proc = psutil.Process(pid)
        assert os.getpgid(pid) == pid != os.getpgid(0)  # its own process group (own session)
        end = time.monotonic() + 5
        while proc.rlimit(psutil.RLIMIT_NOFILE)[0] > caps.max_fds and time.monotonic() < end:
            time.sleep(0.02)  # the worker caps itself first thing
        assert proc.rlimit(psutil.RLIMIT_AS)[0] <= caps.max_memory_bytes
        assert proc.rlimit(psutil.RLIMIT_NOFILE)[0] <= caps.max_fds
        assert proc.rlimit(psutil.RLIMIT_FSIZE)[0] <= caps.max_file_bytes
        assert proc.rlimit(psutil.RLIMIT_CPU)[0] <= caps.max_cpu_s
        peak = 0
        for _ in range(30):  # the leak runs into the address-space ceiling: resident memory stays below it
            try:
                peak = max(peak, proc.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        assert 0 < peak < caps.max_memory_bytes
    assert not _alive(pid)


CHILD = textwrap.dedent("""
    import os, sys, time
    from cothink.experiments.monitor_sim import MonitorScenario, Simulation
    sc = MonitorScenario(id="sig", anomaly="fd_leak", onset_s=0, duration_s=30)
    with Simulation(sc) as sim:
        print(" ".join(str(p) for p in sim.pids.values()), sim.sandbox, flush=True)
        time.sleep(30)
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_cleanup_when_the_simulator_is_interrupted_or_killed(sig):
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        *pids, sandbox = child.stdout.readline().split()
        pids = [int(p) for p in pids]
        assert len(pids) == 4 and all(_alive(p) for p in pids)
        child.send_signal(sig)
        child.wait(timeout=60)  # generous: a loaded CI machine once took over 20 s to exit
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    end = time.monotonic() + 5  # SIGKILL: the kernel's parent-death signal ends the workers
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)
    if sig != signal.SIGKILL:  # a killed process cannot remove its temp dir; the others do
        assert not Path(sandbox).exists()
    else:
        import shutil

        shutil.rmtree(sandbox, ignore_errors=True)


def test_cleanup_on_exception():
    before = _children()
    sc = MonitorScenario(id="exc", anomaly="thread_explosion", onset_s=0, duration_s=30)
    with pytest.raises(RuntimeError, match="boom"):
        with Simulation(sc) as sim:
            sandbox, pids = sim.sandbox, list(sim.pids.values())
            raise RuntimeError("boom")
    assert not sandbox.exists() and _children() == before
    assert not any(_alive(p) for p in pids)


def test_scenario_file_round_trip_and_validation(tmp_path):
    scenarios = builtin_scenarios(3)
    assert len(scenarios) == 3 * len(ANOMALIES) and len({s.id for s in scenarios}) == len(scenarios)
    path = tmp_path / "s.jsonl"
    save_scenarios(scenarios, path)
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) == {"id", "anomaly", "onset_s", "duration_s", "params"}
    assert load_scenarios(path) == scenarios
    path.write_text('{"id": "x", "anomaly": "gpu_melt", "onset_s": 1, "duration_s": 5}\n')
    with pytest.raises(ValueError, match="s.jsonl:1"):
        load_scenarios(path)
    path.write_text('{"id": "x", "anomaly": "fd_leak", "onset_s": 1, "duration_s": 5, "params": {"rm": 1}}\n')
    with pytest.raises(ValueError, match="unknown params"):
        load_scenarios(path)


def _fake_trace(n: int) -> Trace:
    sc = MonitorScenario(id="fake", anomaly="none", onset_s=0, duration_s=n)
    obs = [Observation(i, float(i), (ProcessSample("web", 1, 10, 3, 1, 0, 0, 0, 0),), 0.0) for i in range(n)]
    return Trace(sc, 1.0, obs, {"web": 1})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from cothink.eval.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", hybrid=False, seed=4)


def test_paced_stream_drops_when_late_and_skips_idle_time(tiny):
    handle = harness.load_model(str(tiny))

    async def consume(busy_passes: int) -> mon.PacedStream:
        engine = handle.engine(kv_tokens=4096)
        async with engine:
            stream = mon.PacedStream(engine, _fake_trace(12), passes_per_event=4, backlog=1)
            engine.step_listeners.append(stream.on_step)
            block = engine.block("busy")
            await engine.extend(block, "hello")
            async for _ in stream:
                if busy_passes:  # a slow agent: each observation costs `busy_passes` passes
                    await engine.generate([block], max_tokens=busy_passes, stop_at_eos=False).collect()
        return stream

    idle = asyncio.run(consume(0))
    # an agent that never uses the engine reads everything; the clock jumped over the idle time
    assert idle.events_processed == idle.events_seen == 12 and idle.passes == 0 and idle.skipped == 44
    slow = asyncio.run(consume(10))
    # 10 passes per observation, one due every 4: it falls behind, and late observations are dropped
    assert slow.events_dropped > 0 and slow.events_processed + slow.events_dropped == 12
    assert slow.events_processed < slow.events_seen == 12


def test_quick_run_rows(tiny, tmp_path):
    before = _children()
    parser = argparse.ArgumentParser()
    harness.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "out"
    args = parser.parse_args(["experiment", "monitor", "--model", str(tiny), "--quick", "--out", str(out),
                              "--no-progress", "--passes-per-event", "4"])
    assert args.func(args) == 0
    raw = json.loads((out / "results.json").read_text())
    assert set(raw) == {"config", "rows", "summary"}
    assert (out / "report.md").exists() and (out / "monitor.png").stat().st_size > 1000
    assert (out / "traces.jsonl").exists()
    probes = [json.loads(line) for line in (out / "probes.jsonl").read_text().splitlines()]
    # every model condition probes; the rule engine has no model to probe
    assert {p["condition"] for p in probes} == {"focus-on", "focus-off", "sequential", "turn-based"}
    assert all(0.0 <= p["p_yes"] <= 1.0 and p["t"] >= 0 for p in probes)
    rows = raw["rows"]
    assert len(rows) == 2 * 5
    assert {r["condition"] for r in rows} == {"focus-on", "focus-off", "sequential", "turn-based", "rules"}
    for row in rows:
        assert set(row) == {"scenario", "anomaly", "condition", "predicted", "correct", "forward_passes",
                            "tokens_encoded", "events_seen", "events_processed", "detect_seconds",
                            "read_seconds"}
        assert row["predicted"] in ANOMALIES
        assert row["correct"] == mon.is_correct(row["anomaly"], row["predicted"], row["read_seconds"])
        if row["predicted"] != "none":  # the agent reads what became due: never newer than the report
            assert row["read_seconds"] <= row["detect_seconds"]
        assert 0 < row["events_processed"] <= row["events_seen"] <= 6
        if row["condition"] == "rules":  # no model: no pass, no token, never late
            assert row["forward_passes"] == row["tokens_encoded"] == 0
            assert row["events_processed"] == row["events_seen"]
        else:
            assert row["forward_passes"] > 0 and row["tokens_encoded"] > 0
    summary = raw["summary"]
    assert {"focus-on", "focus-off", "sequential", "turn-based", "rules"} <= set(summary)
    assert {"accuracy", "accuracy_ci95", "false_alarms", "forward_passes", "processed_share"} <= set(
        summary["turn-based"])
    assert [r.model_dump() for r in mon.render(out).rows] == rows
    assert _children() == before


def test_replayed_traces_subset_and_truncation(tmp_path):
    from cothink.experiments.monitor_sim import load_traces, save_traces

    a, b = _fake_trace(6), _fake_trace(4)
    b.scenario = b.scenario.model_copy(update={"id": "other"})
    save_traces([a, b], tmp_path / "t.jsonl")
    assert [t.scenario.id for t in load_traces(tmp_path / "t.jsonl")] == ["fake", "other"]
    parser = argparse.ArgumentParser()
    harness.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["experiment", "monitor", "--traces", str(tmp_path / "t.jsonl"),
                              "--only", "fake", "--max-events", "3"])
    scenarios, traces = mon.load_inputs(args)
    assert [s.id for s in scenarios] == ["fake"] and len(traces[0].observations) == 3
    assert traces[0].observations[2].text().splitlines()[0] == "t=2s"
    assert mon._conditions(parser.parse_args(["experiment", "monitor", "--focus", "on"])) == [
        "focus-on", "sequential", "turn-based", "rules"]


# ------------------------------------------------------------------------------------ the baselines

RECORDED = Path(__file__).resolve().parents[2] / "docs" / "experiments" / "monitor" / "traces.jsonl"


def test_resume_runs_only_the_unfinished_tasks(tiny, tmp_path):
    """A run cut short (its last two tasks missing) is continued with --resume on the same recorded
    streams: the finished tasks and their probes are kept as saved, the missing ones run; a changed
    setting is refused."""
    parser = argparse.ArgumentParser()
    harness.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "out"
    argv = ["experiment", "monitor", "--model", str(tiny), "--traces", str(RECORDED),
            "--only", "memory_leak-1", "none-1", "--max-events", "3", "--passes-per-event", "2",
            "--think-tokens", "4",
            "--conditions", "focus-on", "rules", "--out", str(out), "--no-progress"]
    first = parser.parse_args(argv)
    assert first.func(first) == 0
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["rows"]) == 4
    raw = dict(saved, rows=saved["rows"][:2])
    (out / "results.json").write_text(json.dumps(raw))
    again = parser.parse_args([*argv, "--resume"])
    assert again.func(again) == 0
    resumed = json.loads((out / "results.json").read_text())
    assert resumed["rows"][:2] == saved["rows"][:2], "the finished tasks are kept as saved"
    tasks = [(r["scenario"], r["condition"]) for r in resumed["rows"]]
    assert tasks == [(r["scenario"], r["condition"]) for r in saved["rows"]]
    assert [p["units"] for p in resumed["config"]["earlier_parts"]] == [2]
    # the probes of the kept model task survive beside those of the task run again
    probes = [json.loads(line) for line in (out / "probes.jsonl").read_text().splitlines()]
    assert {(p["scenario"], p["condition"]) for p in probes} == {t for t in tasks if t[1] != "rules"}
    other = parser.parse_args([*argv, "--resume", "--think-tokens", "5"])
    with pytest.raises(harness.ResumeMismatchError, match="think_tokens"):
        other.func(other)


def test_rule_engine_on_recorded_simulator_traces():
    """Deterministic thresholds over the simulator's recorded streams: every fault scenario gets a
    finding of its own type, after its onset; the healthy scenarios get none."""
    from cothink.experiments.monitor_rules import RuleEngine
    from cothink.experiments.monitor_sim import load_traces

    traces = load_traces(RECORDED)
    assert {t.scenario.anomaly for t in traces} == set(ANOMALIES)
    for trace in traces:
        rules = RuleEngine()
        findings = [f for f in (rules.observe(o.text()) for o in trace.observations) if f is not None]
        sc = trace.scenario
        if sc.anomaly == "none":
            assert findings == [], sc.id
            continue
        assert findings, sc.id
        first = findings[0]
        service = f"{sc.service}[{trace.pids[sc.service]}]"
        assert first.anomaly == sc.anomaly and first.subject in (service, "disk"), (sc.id, first)
        assert trace.observations[first.observation].t > sc.onset_s, (sc.id, first)


def test_rule_engine_ignores_single_odd_samples():
    from cothink.experiments.monitor_rules import RuleEngine, parse_observation

    def obs(i: int, rss: float = 11, fds: int = 3, cpu: float = 0, ops: float = 0, disk: float = 0.1) -> str:
        return Observation(i, float(i), (ProcessSample("api", 7, rss, fds, 1, cpu, 0, 0, ops),), disk).text()

    parsed = parse_observation(obs(0, rss=12, fds=5, cpu=3, ops=40, disk=2.5))
    assert parsed.processes == {"api[7]": {"rss": 12, "fds": 5, "thr": 1, "cpu": 3, "wr": 0, "ops": 40}}
    assert parsed.disk_mb == 2.5
    # a start-up burst of IO, a one-off jump of memory, an fd opened for a moment: no finding
    quiet = [obs(0, ops=90), obs(1), obs(2, rss=15), obs(3, rss=15), obs(4, fds=4), obs(5), obs(6)]
    rules = RuleEngine()
    assert [rules.observe(t) for t in quiet] == [None] * len(quiet) and rules.seen == len(quiet)
    # sustained: the same engine fires on the third sample of a steady IO storm
    storm = RuleEngine()
    fired = [storm.observe(t) for t in [obs(0), obs(1, ops=50), obs(2, ops=60), obs(3, ops=55)]]
    assert fired[:3] == [None] * 3 and fired[3] is not None and fired[3].anomaly == "io_slow"


def test_a_finding_before_the_onset_is_a_false_alarm():
    row = dict(scenario="s", condition="focus-on", forward_passes=4, tokens_encoded=9, events_seen=3,
               events_processed=3)
    early = mon.MonitorRow(anomaly="fd_leak", predicted="fd_leak", correct=False, detect_seconds=-2.0,
                           read_seconds=-2.0, **row)
    # late agent: its report came after the onset, but the newest sample it had read was from before it
    stale = mon.MonitorRow(anomaly="fd_leak", predicted="fd_leak", correct=False, detect_seconds=1.0,
                           read_seconds=-1.0, **row)
    late = mon.MonitorRow(anomaly="fd_leak", predicted="fd_leak", correct=True, detect_seconds=1.0,
                          read_seconds=0.0, **row)
    quiet = mon.MonitorRow(anomaly="none", predicted="cpu_spike", correct=False, detect_seconds=-4.0,
                           read_seconds=-4.0, **row)
    silent = mon.MonitorRow(anomaly="none", predicted="none", correct=True, detect_seconds=None, **row)
    assert not mon.is_correct("fd_leak", "fd_leak", -2.0)  # the right name, but before anything happened
    assert mon.is_correct("fd_leak", "fd_leak", 0.0) and mon.is_correct("none", "none", None)
    assert not mon.is_correct("fd_leak", "io_slow", 3.0)
    assert [mon.is_false_alarm(r) for r in (early, stale, late, quiet, silent)] == [True, True, False, True,
                                                                                   False]
    s = mon.summarize([early, stale, late, quiet, silent])["focus-on"]
    assert (s["correct"], s["false_alarms"], s["n"]) == (2, 3, 5)
    lo, hi = s["accuracy_ci95"]
    assert lo < 0.5 < hi


def test_threshold_sweep_takes_the_first_crossing():
    def probe(scenario, anomaly, t, p, condition="focus-on"):
        return {"scenario": scenario, "anomaly": anomaly, "onset_s": 3.0, "condition": condition, "t": t,
                "p_yes": p}

    probes = [
        probe("leak", "fd_leak", 1.0, 0.72), probe("leak", "fd_leak", 3.0, 0.81),
        probe("leak", "fd_leak", 4.0, 0.9),
        probe("quiet", "none", 1.0, 0.6), probe("quiet", "none", 2.0, 0.78),
        probe("leak", "fd_leak", 1.0, 0.5, "turn-based"),
    ]
    sweep = mon.threshold_sweep(probes, (0.7, 0.75, 0.85, 0.95))
    # 0.7: leak crosses before its onset and quiet crosses at all: two false alarms
    assert sweep["focus-on"] == {0.7: (0, 2), 0.75: (1, 1), 0.85: (1, 0), 0.95: (0, 0)}
    assert sweep["turn-based"] == {0.7: (0, 0), 0.75: (0, 0), 0.85: (0, 0), 0.95: (0, 0)}
