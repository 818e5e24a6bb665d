"""A rule engine for the monitoring experiment: fixed thresholds on the psutil signals, no model.

It reads exactly what the model reads: the text of each observation (`monitor_sim.Observation.text()`),
parsed back into numbers. Every rule looks at the last `window` intervals of one signal, so a single
odd sample (a worker's start-up IO, a cache refresh, a log file opened for a moment) never fires one:

- a growth rule (`memory_leak`: a process's rss, `fd_leak`: its fds, `thread_explosion`: its threads,
  `disk_fill`: the disk line of the system) fires when the signal rose in at least `rises` of the
  intervals, fell in none, and grew by at least its threshold over the window;
- a level rule (`cpu_spike`: a process's CPU percent, `io_slow`: its IO operations a second) fires
  when the signal stayed at or above its threshold in each of the last `window` samples.

Rules are checked in the order of `RULES`; the first that fires names the finding. The thresholds
sit between the simulator's normal behaviour (`monitor_worker.py`: flat memory with a cache refresh
of a few MB, fds and threads that blip by one, a few percent of CPU, a log write every few seconds) and
its mildest anomaly rates.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field

_PROCESS = re.compile(
    r"^(?P<name>\S+)\[(?P<pid>\d+)\] rss=(?P<rss>[\d.]+)M fds=(?P<fds>\d+) thr=(?P<thr>\d+) "
    r"cpu=(?P<cpu>[\d.]+)% wr=(?P<wr>[\d.]+)K/s ops=(?P<ops>[\d.]+)/s$"
)
_TOTAL = re.compile(r"^total .* disk=(?P<disk>[\d.]+)M$")


@dataclass(frozen=True)
class Signals:
    """One observation as numbers: per process `name[pid]` -> its signals, and the disk line."""

    processes: dict[str, dict[str, float]]  # "name[pid]" -> {"rss", "fds", "thr", "cpu", "wr", "ops"}
    disk_mb: float


def parse_observation(text: str) -> Signals:
    """The numbers in an observation's text (lines that are not samples, such as `t=12s`, are skipped)."""
    processes: dict[str, dict[str, float]] = {}
    disk = 0.0
    for line in text.splitlines():
        line = line.strip()
        if m := _PROCESS.match(line):
            key = f"{m['name']}[{m['pid']}]"
            processes[key] = {k: float(m[k]) for k in ("rss", "fds", "thr", "cpu", "wr", "ops")}
        elif m := _TOTAL.match(line):
            disk = float(m["disk"])
    return Signals(processes, disk)


@dataclass(frozen=True)
class Thresholds:
    """The rule engine's knobs (defaults: see the module docstring)."""

    window: int = 3  # intervals a rule looks at (window + 1 samples)
    rises: int = 2  # growth rules: intervals in which the signal must rise
    rss_mb: float = 3.0  # memory_leak: growth of one process's rss over the window
    fds: float = 6.0  # fd_leak
    threads: float = 6.0  # thread_explosion
    disk_mb: float = 1.0  # disk_fill: growth of the disk line
    cpu_pct: float = 5.0  # cpu_spike: each of the last `window` samples at or above
    io_ops_s: float = 30.0  # io_slow: each of the last `window` samples at or above


RULES: tuple[tuple[str, str, str], ...] = (  # (anomaly, kind of rule, signal)
    ("memory_leak", "growth", "rss"),
    ("fd_leak", "growth", "fds"),
    ("thread_explosion", "growth", "thr"),
    ("disk_fill", "growth", "disk"),
    ("cpu_spike", "level", "cpu"),
    ("io_slow", "level", "ops"),
)


def _grows(values: list[float], rises: int, amount: float) -> bool:
    steps = [b - a for a, b in zip(values, values[1:])]
    rising = sum(s > 0 for s in steps) >= rises and not any(s < 0 for s in steps)
    return rising and values[-1] - values[0] >= amount


@dataclass(frozen=True)
class RuleFinding:
    anomaly: str
    subject: str  # "name[pid]", or "disk"
    observation: int  # index of the observation (from 0) that fired the rule


@dataclass
class RuleEngine:
    """Feed observations in order with `observe(text)`; it returns a finding when a rule fires."""

    thresholds: Thresholds = field(default_factory=Thresholds)
    seen: int = 0  # observations read
    _history: deque[Signals] = field(init=False)

    def __post_init__(self) -> None:
        self._history = deque(maxlen=self.thresholds.window + 1)

    def _limit(self, signal: str) -> float:
        t = self.thresholds
        return {"rss": t.rss_mb, "fds": t.fds, "thr": t.threads, "disk": t.disk_mb, "cpu": t.cpu_pct,
                "ops": t.io_ops_s}[signal]

    def observe(self, text: str) -> RuleFinding | None:
        self._history.append(parse_observation(text))
        self.seen += 1
        if len(self._history) <= self.thresholds.window:
            return None
        history = list(self._history)
        for anomaly, kind, signal in RULES:
            limit = self._limit(signal)
            if signal == "disk":
                if _grows([s.disk_mb for s in history], self.thresholds.rises, limit):
                    return RuleFinding(anomaly, "disk", self.seen - 1)
                continue
            for key in history[-1].processes:
                if not all(key in s.processes for s in history):
                    continue  # a process that came or went inside the window: not enough samples
                values = [s.processes[key][signal] for s in history]
                fired = (
                    _grows(values, self.thresholds.rises, limit)
                    if kind == "growth"
                    else all(v >= limit for v in values[1:])
                )
                if fired:
                    return RuleFinding(anomaly, key, self.seen - 1)
        return None
