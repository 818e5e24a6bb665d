"""A local anomaly simulator in the DevOps-Gym monitoring task shape.

A scenario starts a few small, real service processes on this machine: background noise (`web`, `cron`,
`cache`) and one more service that behaves normally until `onset_s`, then shows one anomaly for the rest
of the scenario: `memory_leak`, `fd_leak`, `cpu_spike`, `disk_fill` (inside the scenario's temp dir),
`io_slow`, `thread_explosion`, or nothing (`none`). The processes run `monitor_worker.py`.

Safety: every process caps itself (address space, open files, file size, CPU seconds; see
`ProcessCaps`) and exits by itself at the scenario's end; each runs in its own session (so its own
process group) and dies with the simulator (PR_SET_PDEATHSIG). `Simulation` kills every group and
removes its temp dir when its `with` block ends, also on an exception or Ctrl-C; an atexit hook and a
SIGTERM handler (installed while simulations are live, when no other handler is set) do the same for
simulations that were never closed.

The agent never sees the scenario: only `Observation`s, sampled with psutil every `interval_s` seconds
from the scenario's processes, rendered as text events (`Observation.text()`)::

    t=12s
    web[4310] rss=10M fds=4 thr=1 cpu=2% wr=0K/s ops=0/s
    cron[4311] rss=11M fds=3 thr=1 cpu=0% wr=24K/s ops=2/s
    cache[4312] rss=27M fds=3 thr=1 cpu=0% wr=0K/s ops=0/s
    api[4313] rss=34M fds=12 thr=3 cpu=1% wr=12K/s ops=3/s
    total rss=82M fds=22 thr=6 cpu=3% disk=0.1M

`t` is seconds since the scenario started; per process `name[pid]`: resident memory (MB), open file
descriptors, threads, CPU percent of one core over the last interval, bytes written per second and IO
operations (reads + writes) per second; `total` sums the processes and adds the bytes on the scenario's
disk (its temp dir). Samples keep read rates too (`read_kb_s`), left out of the text to keep it short:
every digit is a token for most tokenizers.

Scenario files are JSONL, one object a line:
`{"id": "mem-1", "anomaly": "memory_leak", "onset_s": 6, "duration_s": 20, "params": {"rate_mb_s": 2}}`.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

Anomaly = Literal["memory_leak", "fd_leak", "cpu_spike", "disk_fill", "io_slow", "thread_explosion", "none"]
ANOMALIES: tuple[str, ...] = (
    "memory_leak",
    "fd_leak",
    "cpu_spike",
    "disk_fill",
    "io_slow",
    "thread_explosion",
    "none",
)
NOISE = ("web", "cron", "cache")
SERVICE_NAMES = ("api", "indexer", "uploader", "billing")
WORKER = Path(__file__).with_name("monitor_worker.py")
MB = 1 << 20


class MonitorScenario(BaseModel):
    """One task: which anomaly, when it starts, how long the scenario runs, and its knobs."""

    id: str
    anomaly: Anomaly
    onset_s: float = Field(ge=0)
    duration_s: float = Field(gt=0, le=600)
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("params")
    @classmethod
    def _known_params(cls, v: dict[str, Any]) -> dict[str, Any]:
        known = {"service", "rate_mb_s", "cap_mb", "rate_per_s", "cap", "duty", "ops_per_s"}
        unknown = set(v) - known
        if unknown:
            raise ValueError(f"unknown params {sorted(unknown)}; known: {sorted(known)}")
        return v

    @property
    def service(self) -> str:
        """The service that turns anomalous (a name that does not give the anomaly away)."""
        if "service" in self.params:
            return str(self.params["service"])
        return SERVICE_NAMES[sum(map(ord, self.id)) % len(SERVICE_NAMES)]


def load_scenarios(path: str | Path) -> list[MonitorScenario]:
    """Read a JSONL scenario file (blank lines and `#` comments are skipped)."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            try:
                out.append(MonitorScenario.model_validate_json(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: {exc}") from exc
    return out


def save_scenarios(scenarios: Iterable[MonitorScenario], path: str | Path) -> None:
    Path(path).write_text("".join(s.model_dump_json() + "\n" for s in scenarios))


def builtin_scenarios(per_anomaly: int = 3, duration_s: float = 20.0) -> list[MonitorScenario]:
    """`per_anomaly` scenarios of each type (none included), with varied onsets and rates."""
    knobs: dict[str, list[dict[str, Any]]] = {
        "memory_leak": [{"rate_mb_s": 2.0}, {"rate_mb_s": 1.0}, {"rate_mb_s": 4.0, "cap_mb": 48}],
        "fd_leak": [{"rate_per_s": 8}, {"rate_per_s": 4}, {"rate_per_s": 15}],
        "cpu_spike": [{"duty": 0.5}, {"duty": 0.35}, {"duty": 0.7}],
        "disk_fill": [{"rate_mb_s": 1.0}, {"rate_mb_s": 0.5}, {"rate_mb_s": 2.0}],
        "io_slow": [{"ops_per_s": 150}, {"ops_per_s": 80}, {"ops_per_s": 250}],
        "thread_explosion": [{"rate_per_s": 10}, {"rate_per_s": 5}, {"rate_per_s": 20}],
        "none": [{}, {}, {}],
    }
    out = []
    for anomaly in ANOMALIES:
        for i in range(per_anomaly):
            params = dict(knobs[anomaly][i % 3])
            params["service"] = SERVICE_NAMES[(i + ANOMALIES.index(anomaly)) % len(SERVICE_NAMES)]
            onset = round(duration_s * (0.25 + 0.1 * (i % 3)), 1)
            out.append(
                MonitorScenario(
                    id=f"{anomaly}-{i + 1}",
                    anomaly=anomaly,
                    onset_s=onset,
                    duration_s=duration_s,
                    params=params,
                )
            )
    return out


# ------------------------------------------------------------------------------------ observations
@dataclass(frozen=True)
class ProcessSample:
    name: str
    pid: int
    rss_mb: float
    fds: int
    threads: int
    cpu_pct: float
    read_kb_s: float
    write_kb_s: float
    io_ops_s: float

    def text(self) -> str:
        return (
            f"{self.name}[{self.pid}] rss={self.rss_mb:.0f}M fds={self.fds} thr={self.threads} "
            f"cpu={self.cpu_pct:.0f}% wr={self.write_kb_s:.0f}K/s ops={self.io_ops_s:.0f}/s"
        )


@dataclass(frozen=True)
class Observation:
    """One sampling tick: every live service process plus the system line. One event of the stream."""

    index: int
    t: float  # seconds since the scenario started
    processes: tuple[ProcessSample, ...]
    disk_mb: float

    def text(self) -> str:
        ps = self.processes
        total = (
            f"total rss={sum(p.rss_mb for p in ps):.0f}M fds={sum(p.fds for p in ps)} "
            f"thr={sum(p.threads for p in ps)} cpu={sum(p.cpu_pct for p in ps):.0f}% disk={self.disk_mb:.1f}M"
        )
        return "\n".join([f"t={self.t:.0f}s", *(p.text() for p in ps), total])

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "t": self.t,
            "disk_mb": self.disk_mb,
            "processes": [p.__dict__ for p in self.processes],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Observation:
        return cls(d["index"], d["t"], tuple(ProcessSample(**p) for p in d["processes"]), d["disk_mb"])


@dataclass
class Trace:
    """A recorded scenario: what the agent may see (observations) and the truth it must not."""

    scenario: MonitorScenario
    interval_s: float
    observations: list[Observation]
    pids: dict[str, int]  # service name -> pid

    @property
    def anomalous_pid(self) -> int | None:
        return None if self.scenario.anomaly == "none" else self.pids.get(self.scenario.service)

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario.model_dump(),
            "interval_s": self.interval_s,
            "pids": self.pids,
            "observations": [o.to_json() for o in self.observations],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Trace:
        return cls(
            MonitorScenario.model_validate(d["scenario"]),
            d["interval_s"],
            [Observation.from_json(o) for o in d["observations"]],
            d["pids"],
        )


# ------------------------------------------------------------------------------------ the simulator
@dataclass(frozen=True)
class ProcessCaps:
    """Hard limits of every simulated process (on top of the anomaly's own, smaller, limits)."""

    headroom_bytes: int = 160 * MB  # address space beyond the leak's cap (interpreter, thread stacks)
    fds: int = 64  # beyond the leak's cap
    file_bytes: int = 4 * MB  # beyond the disk fill's cap, per file
    cpu_s_slack: float = 2.0
    # ceilings whatever a scenario's params ask for
    max_memory_bytes: int = 512 * MB
    max_fds: int = 1024
    max_file_bytes: int = 256 * MB
    max_cpu_s: int = 120


# one malloc arena: every thread's arena would reserve 64 MB of address space against the cap
_WORKER_ENV = {"PATH": os.environ.get("PATH", ""), "MALLOC_ARENA_MAX": "1"}
_LIVE: set[Simulation] = set()
_LIVE_LOCK = threading.Lock()
_previous_sigterm: Any = None


def _close_all() -> None:
    for sim in list(_LIVE):
        sim.close()


def _on_sigterm(signum: int, frame: Any) -> None:
    _close_all()
    raise SystemExit(128 + signum)


def _register(sim: Simulation) -> None:
    global _previous_sigterm
    with _LIVE_LOCK:
        _LIVE.add(sim)
        if (
            _previous_sigterm is None
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)
        ):
            _previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)


def _unregister(sim: Simulation) -> None:
    global _previous_sigterm
    with _LIVE_LOCK:
        _LIVE.discard(sim)
        if (
            not _LIVE
            and _previous_sigterm is not None
            and threading.current_thread() is threading.main_thread()
        ):
            signal.signal(signal.SIGTERM, _previous_sigterm)
            _previous_sigterm = None


atexit.register(_close_all)


@dataclass(eq=False)
class Simulation:
    """Runs one scenario's processes. Use as a context manager; `close()` is idempotent."""

    scenario: MonitorScenario
    interval_s: float = 1.0
    caps: ProcessCaps = field(default_factory=ProcessCaps)
    sandbox: Path | None = field(default=None, init=False)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict, init=False)
    started: float = field(default=0.0, init=False)
    _psutil: dict[int, Any] = field(default_factory=dict, init=False, repr=False)
    _io_last: dict[int, tuple[float, int, int, int]] = field(default_factory=dict, init=False, repr=False)
    _index: int = field(default=0, init=False)

    def __enter__(self) -> Simulation:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spec(self, name: str, role: str, anomalous: bool) -> dict[str, Any]:
        sc, p, c = self.scenario, self.scenario.params, self.caps
        leak_mb = float(p.get("cap_mb", 64)) if anomalous and sc.anomaly == "memory_leak" else 0.0
        fd_cap = int(p.get("cap", 400)) if anomalous and sc.anomaly == "fd_leak" else 0
        disk_mb = float(p.get("cap_mb", 32)) if anomalous and sc.anomaly == "disk_fill" else 0.0
        return {
            "name": name,
            "role": role,
            "sandbox": str(self.sandbox),
            "wall_s": sc.duration_s + 1.0,
            "onset_s": sc.onset_s if anomalous else None,
            "anomaly": sc.anomaly if anomalous and sc.anomaly != "none" else None,
            "params": p,
            "seed": sum(map(ord, f"{sc.id}/{name}")),
            "parent": os.getpid(),
            "caps": {
                "memory_bytes": min(int(leak_mb * MB) + c.headroom_bytes, c.max_memory_bytes),
                "fds": min(fd_cap + c.fds, c.max_fds),
                "file_bytes": min(int(disk_mb * MB) + c.file_bytes, c.max_file_bytes),
                "cpu_s": min(int(sc.duration_s + c.cpu_s_slack) + 1, c.max_cpu_s),
            },
        }

    def start(self) -> None:
        import psutil

        if self.sandbox is not None:
            raise RuntimeError("simulation already started")
        _register(self)
        try:
            self.sandbox = Path(tempfile.mkdtemp(prefix=f"cothink-monitor-{self.scenario.id}-"))
            services = [(n, n, False) for n in NOISE] + [(self.scenario.service, "service", True)]
            self.started = time.monotonic()
            for name, role, anomalous in services:
                spec = self._spec(name, role, anomalous)
                self.procs[name] = subprocess.Popen(
                    [sys.executable, "-I", "-S", str(WORKER), json.dumps(spec)],
                    cwd=self.sandbox,
                    env=_WORKER_ENV,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                    close_fds=True,
                )
                self._psutil[self.procs[name].pid] = psutil.Process(self.procs[name].pid)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items()}

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def close(self) -> None:
        """Kill every process group, reap the processes and remove the sandbox."""
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not fail
                proc.kill()
                proc.wait()
        if self.sandbox is not None:
            shutil.rmtree(self.sandbox, ignore_errors=True)
        _unregister(self)

    def _disk_mb(self) -> float:
        total = 0
        try:
            for entry in os.scandir(self.sandbox):
                try:
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
                except FileNotFoundError:
                    pass
        except FileNotFoundError:
            pass
        return total / MB

    def sample(self) -> Observation:
        """One observation of the live processes (rates over the time since the previous sample)."""
        import psutil

        now = time.monotonic()
        rows = []
        for name, proc in self.procs.items():
            ps = self._psutil[proc.pid]
            try:
                with ps.oneshot():
                    rss = ps.memory_info().rss / MB
                    fds, threads = ps.num_fds(), ps.num_threads()
                    cpu = ps.cpu_percent(interval=None)  # since the previous call (0.0 on the first)
                    io = ps.io_counters()
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
            last = self._io_last.get(proc.pid)
            ops = io.read_count + io.write_count
            if last is None:
                rd = wr = op = 0.0
            else:
                dt = max(now - last[0], 1e-3)
                rd, wr = (io.read_chars - last[1]) / dt / 1024, (io.write_chars - last[2]) / dt / 1024
                op = (ops - last[3]) / dt
            self._io_last[proc.pid] = (now, io.read_chars, io.write_chars, ops)
            rows.append(ProcessSample(name, proc.pid, rss, fds, threads, cpu, rd, wr, op))
        obs = Observation(self._index, round(now - self.started, 1), tuple(rows), self._disk_mb())
        self._index += 1
        return obs

    def _grid(self) -> Iterable[float]:
        """Due times of the samples: every `interval_s` seconds until the scenario's end."""
        self.sample()  # primes the CPU and IO counters
        k = 1
        while (due := self.started + k * self.interval_s) <= self.started + self.scenario.duration_s + 1e-6:
            yield due
            k += 1

    async def stream(self) -> AsyncIterator[Observation]:
        """Observations on a fixed grid, without blocking the event loop between samples."""
        for due in self._grid():
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            yield self.sample()

    def samples(self) -> Iterable[Observation]:
        """The same observations, for synchronous code (sleeps between samples)."""
        for due in self._grid():
            time.sleep(max(0.0, due - time.monotonic()))
            yield self.sample()


def record(scenario: MonitorScenario, interval_s: float = 1.0, caps: ProcessCaps | None = None) -> Trace:
    """Run `scenario` live and record its observation stream (blocking for `duration_s`)."""
    with Simulation(scenario, interval_s, caps or ProcessCaps()) as sim:
        observations = list(sim.samples())
        return Trace(scenario, interval_s, observations, sim.pids)


def save_traces(traces: Iterable[Trace], path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps(t.to_json()) + "\n" for t in traces))


def load_traces(path: str | Path) -> list[Trace]:
    return [Trace.from_json(json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]
