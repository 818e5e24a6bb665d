"""A wheel built from this repository carries the C kernels' source: installed into a fresh virtual
environment, outside the checkout, it builds and runs them (`cothink info --json`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from support import QUICK_KERNEL_BUILD

from cothink.ops import native

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_a_wheel_installed_in_a_fresh_venv_runs_the_native_kernels(tmp_path):
    # build from a copy of what a release holds, so the checkout gets no build/ or egg-info of its own
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    shutil.copytree(ROOT / "src", project / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so"))
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", str(wheels), str(project)], cwd=tmp_path)
    (wheel,) = wheels.glob("cothink-*.whl")
    assert "cothink/ops/native.c" in zipfile.ZipFile(wheel).namelist()

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
          str(wheel)], cwd=tmp_path)
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path).strip())
    # torch and the other dependencies from the test environment, without reinstalling them; added
    # after the install so pip never sees the checkout's editable cothink there. A path line in a .pth
    # file does not run that folder's own .pth files, so the checkout's src stays off sys.path.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COTHINK_NATIVE")}
    env["COTHINK_CACHE"] = str(tmp_path / "cache")
    env["COTHINK_NATIVE_CFLAGS"] = QUICK_KERNEL_BUILD
    report = json.loads(_run([str(python), "-m", "cothink", "info", "--json"], cwd=outside, env=env))
    assert report["native"] is True, report["kernels"]["reason"]
    assert Path(report["location"]).is_relative_to(site)
    assert Path(report["kernels"]["library"]).is_relative_to(tmp_path / "cache" / "native")
    assert report["kernels"]["abi"] == native.ABI_VERSION and report["kernels"]["reason"] is None
    # and the installed module's kernels run: an RMSNorm as the torch ops compute it
    code = (
        "import torch; from cothink.ops import native\n"
        "x, w = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)), torch.rand(64) + 0.5\n"
        "want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))\n"
        "torch.testing.assert_close(native.rms_norm(x, w, 1e-6, False)[0], want, atol=1e-6, rtol=1e-6)\n"
        "print(native.__file__)"
    )
    module = Path(_run([str(python), "-c", code], cwd=outside, env=env).strip())
    assert module.is_relative_to(site) and module.with_name("native.c").is_file()
