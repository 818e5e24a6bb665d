"""`cothink info`: versions, the CPU and the C kernels' status, the same record /health reports;
`python -m cothink` is the `cothink` command line."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import httpx
import torch
from support import make_engine, running_server

import cothink
from cothink import cli
from cothink.ops import native


def _info(capsys, *argv: str) -> str:
    assert cli.main(["info", *argv]) == 0
    return capsys.readouterr().out


def test_info_json_reports_versions_cpu_threads_and_the_kernels(capsys):
    report = json.loads(_info(capsys, "--json"))
    assert report["cothink"] == cothink.__version__ and report["python"] == platform.python_version()
    assert report["torch"] == torch.__version__ and report["torch_threads"] == torch.get_num_threads()
    assert Path(report["location"]) == Path(cothink.__file__).parent
    assert report["cpu"] and set(report["cpu_flags"]) <= set(cli.CPU_FLAGS)
    state = native.status()
    assert report["native"] is state.available and report["kernels"] == asdict(state)
    if Path("/proc/cpuinfo").exists():
        flags = {f for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith(("flags", "Features")) for f in line.split(":", 1)[1].split()}
        assert report["cpu_flags"] == [f for f in cli.CPU_FLAGS if f in flags]


def test_info_text_says_native_and_why_not(capsys, monkeypatch):
    lines = dict(line.split(":", 1) for line in _info(capsys).splitlines())
    assert lines["torch"].strip() == torch.__version__
    if native.available():
        assert lines["native"].strip().startswith(f"true ({native.status().library}")
    monkeypatch.setattr(native, "ENABLED", False)  # as COTHINK_NATIVE=0 does
    report = json.loads(_info(capsys, "--json"))
    assert report["native"] is False
    assert report["kernels"]["reason"] == "switched off (native.ENABLED = False)"
    assert "native:    false: switched off" in _info(capsys)


def test_health_reports_the_kernels_as_info_does(capsys):
    report = json.loads(_info(capsys, "--json"))
    with running_server(make_engine("llama_1l", kv_tokens=256)) as server:
        health = httpx.get(server.url + "/health", timeout=30).json()
    assert health["status"] == "ok" and health["kernels"] == report["kernels"]


def test_python_dash_m_cothink_is_the_cothink_command_line(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # argparse's width, here and in the child
    out = subprocess.run([sys.executable, "-m", "cothink", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout == cli.build_parser().format_help()
    assert "info" in out.stdout and "kernels" in out.stdout
