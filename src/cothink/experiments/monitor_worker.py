"""One simulated service process of the monitoring experiment (run by path, standard library only).

    python -I -S monitor_worker.py '<json spec>'

The spec names the service's normal behaviour (`role`: web, cron, cache, service) and, for the one
anomalous service, the anomaly, its onset and parameters. The process caps itself before doing anything
(address space, open files, file size, CPU seconds), asks the kernel to kill it when its parent dies,
stops by itself at `wall_s`, and keeps its CPU use small: it sleeps in short ticks between small pieces
of work. Only `cpu_spike` burns CPU, at a bounded duty cycle, for a bounded time.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import resource
import signal
import sys
import threading
import time

TICK_S = 0.1
MB = 1 << 20


def _cap(spec: dict) -> None:
    caps = spec["caps"]
    resource.setrlimit(resource.RLIMIT_AS, (caps["memory_bytes"], caps["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (caps["fds"], caps["fds"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (caps["file_bytes"], caps["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_CPU, (caps["cpu_s"], caps["cpu_s"] + 1))
    try:  # PR_SET_PDEATHSIG = 1: SIGKILL when the simulator process goes away, however it goes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != spec["parent"]:  # the simulator died before the line above: nobody to serve
        os._exit(0)
    # a full disk or file cap must end the writer quietly, not with SIGXFSZ's core dump
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


class Service:
    def __init__(self, spec: dict):
        self.spec = spec
        self.dir = spec["sandbox"]
        self.name = spec["name"]
        self.params = spec.get("params", {})
        self.kept: list[bytearray] = []  # memory the service holds
        self.fds: list[int] = []
        self.threads: list[threading.Thread] = []
        self.stop = threading.Event()
        self.log_path = os.path.join(self.dir, f"{self.name}.log")
        self.data_path = os.path.join(self.dir, f"{self.name}.dat")
        self.written = 0
        self.io_writes = 0
        self.t = 0.0
        self.last_mb = 0.0
        self.scratch: bytearray | None = None
        self.rng = random.Random(spec.get("seed", 0))

    # ---- normal behaviour: small, periodic, bounded (noise the agent must learn to ignore)
    def normal(self, tick: int) -> None:
        role, rng = self.spec["role"], self.rng
        if role == "cache":
            if tick == 0:
                self.kept.append(bytearray(b"\x01") * (16 * MB))
            if tick % 40 == 0:  # a cache refresh: a few MB come and go
                self.scratch = bytearray(b"\x01") * (rng.randint(1, 4) * MB) if rng.random() < 0.5 else None
        if role in ("web", "service") and rng.random() < 0.3:
            sum(i * i for i in range(rng.randint(1000, 6000)))  # a request (1-4 ms of CPU)
        if role in ("cron", "service") and tick % 30 == 0:
            with open(self.log_path, "a") as f:
                f.write("job ok\n" * rng.randint(100, 4000))
            if os.path.getsize(self.log_path) > 256 * 1024:
                os.truncate(self.log_path, 0)

    # ---- the anomaly, from onset on
    def anomaly(self, elapsed: float) -> float:
        """Do one tick of the anomaly; returns the seconds of the tick it already spent."""
        kind, p = self.spec["anomaly"], self.params
        if kind == "memory_leak":
            target = min(p.get("rate_mb_s", 2.0) * elapsed, p.get("cap_mb", 64))
            while self.last_mb + 1 <= target:
                self.kept.append(bytearray(b"\x01") * MB)  # written, so resident
                self.last_mb += 1
        elif kind == "fd_leak":
            target = min(int(p.get("rate_per_s", 8) * elapsed), p.get("cap", 400))
            while len(self.fds) < target:
                try:
                    self.fds.append(os.open(self.log_path, os.O_RDONLY | os.O_CREAT))
                except OSError:
                    break
        elif kind == "cpu_spike":
            busy = TICK_S * min(p.get("duty", 0.5), 0.9)
            end = time.perf_counter() + busy
            while time.perf_counter() < end:
                sum(i * i for i in range(2000))
            return busy
        elif kind == "disk_fill":
            target = min(p.get("rate_mb_s", 1.0) * elapsed, p.get("cap_mb", 32)) * MB
            if self.written < target:
                chunk = int(target - self.written)
                try:
                    with open(self.data_path, "ab") as f:
                        f.write(b"\x00" * chunk)
                    self.written += chunk
                except OSError:
                    pass
        elif kind == "io_slow":
            # many tiny synchronous writes and re-reads: lots of IO operations, little data
            n = max(1, int(p.get("ops_per_s", 150) * TICK_S))
            fd = os.open(self.data_path, os.O_RDWR | os.O_CREAT)
            try:
                for _ in range(n):
                    os.write(fd, b"x" * 512)
                    os.fsync(fd)
                    os.pread(fd, 512, 0)
                    self.io_writes += 1
                if self.io_writes % 2000 < n:
                    os.ftruncate(fd, 0)
            finally:
                os.close(fd)
        elif kind == "thread_explosion":
            target = min(int(p.get("rate_per_s", 10) * elapsed), p.get("cap", 150))
            while len(self.threads) < target:
                t = threading.Thread(target=self.stop.wait, daemon=True)
                try:
                    t.start()
                except RuntimeError:
                    break
                self.threads.append(t)
        return 0.0

    def run(self) -> None:
        start = time.monotonic()
        wall = self.spec["wall_s"]
        onset = self.spec.get("onset_s")
        tick = 0
        while True:
            now = time.monotonic() - start
            if now >= wall:
                break
            self.normal(tick)
            spent = 0.0
            if onset is not None and self.spec.get("anomaly") and now >= onset:
                spent = self.anomaly(now - onset)
            tick += 1
            time.sleep(max(0.0, TICK_S - spent))
        self.stop.set()


def main() -> None:
    spec = json.loads(sys.argv[1])
    _cap(spec)
    threading.stack_size(256 * 1024)  # thread stacks count against the address-space cap
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    Service(spec).run()


if __name__ == "__main__":
    main()
