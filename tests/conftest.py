"""Test-wide setup: quiet transformers, one torch thread per test, the shared fixtures of tests/support.py.

Helpers and the tiny-model zoo live in tests/support.py (importable as `support`: pytest's pythonpath
includes tests/). Test modules are imported with `--import-mode=importlib` (pyproject), so test files in
different layer folders may share a basename.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytest
import torch
from support import ERRORS, keep_largest_error, record_error, tiny_model  # noqa: F401  (session fixtures)

# ---- quiet transformers: kernel fallback notices, progress bars, generation hints -------------
warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")


def _silence_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


_silence_transformers()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "torch_threads(n): run this test with n torch threads (None: leave the count as it is) "
        "instead of the default single thread")


@pytest.fixture(autouse=True)
def _torch_threads(request: pytest.FixtureRequest):
    """One torch thread for every test unless it opts out with @pytest.mark.torch_threads(n).

    Tiny models' kernels are microseconds long: with several OpenMP threads on a busy 2-core machine the
    threads' spin-waits cost 30-50x (measured: 186 ms vs 4 ms per tiny decode step)."""
    marker = request.node.get_closest_marker("torch_threads")
    threads = marker.args[0] if marker else 1
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On a pytest-xdist worker: hand the worker's largest errors to the controller's summary."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["logit_errors"] = [[group, name, err] for (group, name), err in ERRORS.items()]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """On the pytest-xdist controller: merge a finished worker's errors (the largest per key)."""
    for group, name, err in getattr(node, "workeroutput", {}).get("logit_errors", []):
        keep_largest_error(group, name, err)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Largest error seen per (test group, model name), from the `record_error` fixture."""
    if not ERRORS:
        return
    terminalreporter.section("max |logit error| per model")
    for (group, name), err in sorted(ERRORS.items()):
        terminalreporter.write_line(f"{group:<28} {name:<18} {err:.2e}")
