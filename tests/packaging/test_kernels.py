"""The C kernels' library is checked before use and says why it does not run: a cached library of
another ABI is rebuilt, never called; without a compiler an engine falls back to the torch path with a
warning, or, under COTHINK_REQUIRE_NATIVE=1, fails with NativeKernelError."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from support import QUICK_KERNEL_BUILD, make_engine, tiny_folder

from cothink.ops import native

needs_kernels = pytest.mark.skipif(not native.available(), reason="cothink's C kernels did not build here")

# a library in the cache's place that reports another ABI (or none: a build older than the check); its
# RMSNorm leaves a file behind if anything calls it
STALE_SOURCE = """
#include <stdio.h>
#ifdef VERSION
int ct_abi_version(void) { return VERSION; }
#endif
void ct_rms_norm(void) { FILE *f = fopen(MARKER, "w"); if (f) fclose(f); }
"""


@pytest.fixture
def fresh_load(tmp_path, monkeypatch):
    """native's library loaded anew from an empty cache in tmp_path, built quickly (QUICK_KERNEL_BUILD),
    and as before after the test."""
    monkeypatch.setenv("COTHINK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_FLAGS", [*native._FLAGS, QUICK_KERNEL_BUILD])
    native._load.cache_clear()
    yield
    native._load.cache_clear()


@needs_kernels
@pytest.mark.parametrize("version", [native.ABI_VERSION + 1, None])
def test_a_stale_cached_library_is_rebuilt_and_never_called(tmp_path, fresh_load, caplog, version):
    compiler = native._compiler()
    target = native._target(compiler)
    target.parent.mkdir(parents=True)
    (tmp_path / "stale.c").write_text(STALE_SOURCE)
    marker = tmp_path / "stale-called"
    defines = [f'-DMARKER="{marker}"'] + ([] if version is None else [f"-DVERSION={version}"])
    subprocess.run([compiler, "-shared", "-fPIC", *defines, "-o", str(target), str(tmp_path / "stale.c")],
                   check=True)
    stale_bytes = target.read_bytes()

    with caplog.at_level(logging.WARNING, logger="cothink.ops.native"):
        state = native.status()
    assert state.available and state.reason is None
    assert state.library == str(target) and state.abi == native.ABI_VERSION
    assert target.read_bytes() != stale_bytes  # rebuilt in its place, for the next process too
    assert f"has ABI {version}" in caplog.text and "rebuilding" in caplog.text
    x = torch.randn(2, 32)
    normed, _ = native.rms_norm(x, torch.ones(32), 1e-6, False)
    torch.testing.assert_close(normed, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert not marker.exists()


@needs_kernels
def test_the_loaded_library_reports_the_abi_this_module_calls():
    lib, state = native._load()
    assert state.available and native._abi_of(lib) == native.ABI_VERSION == state.abi


ENGINE_SCRIPT = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
from cothink import SyncEngine
from cothink.errors import NativeKernelError
from cothink.ops import native
try:
    engine = SyncEngine.from_pretrained(sys.argv[1], kv_tokens=256)
except NativeKernelError as err:
    print(json.dumps({"error": type(err).__name__, "message": str(err)}))
    sys.exit(0)
with engine:
    block = engine.block("b")
    engine.extend(block, token_ids=[1, 2, 3])
    tokens = [t for piece in engine.stream([block], max_tokens=3) for t in piece.token_ids]
state = native.status()
print(json.dumps({"native": state.available, "reason": state.reason, "tokens": len(tokens)}))
"""


def _engine_without_compiler(tmp_path, **env: str) -> tuple[dict, str]:
    """Load a tiny model, and generate on it, in a process where the compiler fails (`CC=/bin/false`)
    and the kernel cache is empty -> (its JSON line, its log)."""
    env = {**os.environ, "CC": "/bin/false", "COTHINK_CACHE": str(tmp_path / "cache"),
           "COTHINK_REQUIRE_NATIVE": "0", **env}
    done = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(tiny_folder("llama_1l"))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_without_a_compiler_the_engine_falls_back_with_a_warning(tmp_path):
    out, log = _engine_without_compiler(tmp_path)
    assert out["native"] is False and out["tokens"] == 3
    assert out["reason"].startswith("build failed: /bin/false") and "exited with status 1" in out["reason"]
    assert "WARNING cothink.engine engine on the CPU without cothink's C kernels" in log


def test_required_kernels_that_cannot_build_fail_with_a_typed_error(tmp_path):
    out, _ = _engine_without_compiler(tmp_path, COTHINK_REQUIRE_NATIVE="1")
    assert out["error"] == "NativeKernelError"
    assert "COTHINK_REQUIRE_NATIVE=1" in out["message"] and "/bin/false" in out["message"]


@needs_kernels
def test_the_engine_start_log_names_the_loaded_kernels(caplog):
    engine = make_engine("llama_1l", kv_tokens=256)

    async def start_stop() -> None:
        await engine.start()
        await engine.stop()

    with caplog.at_level(logging.INFO, logger="cothink.engine"):
        asyncio.run(start_stop())
    (record,) = [r for r in caplog.records if "C kernels" in r.getMessage()]
    assert record.levelno == logging.INFO and native.status().library in record.getMessage()
