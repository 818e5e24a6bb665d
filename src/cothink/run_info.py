"""What a result was measured on: the commit, the machine and the versions, one record for every results
folder (``cothink eval``, ``cothink experiment``, ``bench/``).

    info = run_info()            # RunInfo: commit, dirty, cpu, torch, python, threads, started_at
    json.dumps(info.as_dict())   # as written into results.json / config.json / a bench JSON

The commit is ``git rev-parse HEAD`` of the checkout cothink is imported from ("unknown" outside a git
checkout, e.g. an installed wheel, or without git); ``dirty`` says whether that checkout had uncommitted
changes to tracked files (None when the commit is unknown).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class RunInfo:
    """One run's provenance, written verbatim into its results."""

    commit: str  # full hash of HEAD, or "unknown"
    dirty: bool | None  # uncommitted changes to tracked files; None when the commit is unknown
    cpu: str  # the CPU model, as /proc/cpuinfo names it
    cores: int  # logical CPUs
    torch: str  # torch.__version__
    torch_threads: int  # torch.get_num_threads() when the run started
    python: str  # platform.python_version()
    started_at: str  # UTC, ISO 8601 to the second

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def line(self) -> str:
        """One line for a report header."""
        state = "" if self.dirty is None else (" (dirty)" if self.dirty else "")
        return (
            f"commit {self.commit[:12]}{state}; {self.cpu}, {self.cores} CPUs; torch {self.torch} with "
            f"{self.torch_threads} threads; Python {self.python}; started {self.started_at}"
        )


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the first ``model name``), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or platform.machine() or UNKNOWN


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (``flags``, or ``Features`` on Arm); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def _git(where: Path, *args: str) -> str | None:
    """git's stdout in folder `where`; None outside a checkout or without git."""
    try:
        done = subprocess.run(
            ["git", *args],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def package_folder() -> Path:
    """The folder the running cothink is imported from."""
    import cothink

    return Path(cothink.__file__).resolve().parent


def git_commit(where: Path | None = None) -> tuple[str, bool | None]:
    """(HEAD's hash, whether tracked files differ from it) of the checkout holding `where` (default: the
    imported cothink), or ("unknown", None) outside a checkout."""
    where = where or package_folder()
    head = _git(where, "rev-parse", "HEAD")
    if head is None:
        return UNKNOWN, None
    status = _git(where, "status", "--porcelain", "--untracked-files=no")
    return head.strip(), None if status is None else bool(status.strip())


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run_info() -> RunInfo:
    """This run's provenance, now (imports torch)."""
    import torch

    commit, dirty = git_commit()
    return RunInfo(
        commit=commit,
        dirty=dirty,
        cpu=cpu_model(),
        cores=os.cpu_count() or 1,
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        python=platform.python_version(),
        started_at=now_utc(),
    )
