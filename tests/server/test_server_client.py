"""cothink.client (async), the HTTP thinker/narrator example, and `cothink serve` as a real process."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support import running_server, tiny_chat_model_dir, tiny_engine

from cothink.client import AsyncClient, ClientError
from cothink.server import ServerSettings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server():
    with running_server(tiny_engine(), ServerSettings(model_name="tiny", api_keys=("k",))) as srv:
        yield srv


def test_async_client_round_trip(server):
    async def main():
        async with AsyncClient(server.url, api_key="k") as client:
            assert (await client.health())["status"] == "ok"
            assert await client.models() == ["tiny"]
            async with await client.session("async") as s:
                a = await s.block("Hello")
                out = await s.block()
                events = [e async for e in s.stream([a, out], max_tokens=3, stop_at_eos=False)]
                assert [e["type"] for e in events][0] == "start" and events[-1]["finish_reason"] == "length"
                fork = await s.fork(out)
                assert fork.length == 3
                await s.truncate(out, 1)
                assert (await s.get_block(out)).length == 1
                await s.extend(out, token_ids=[5, 6], view=[a, out])
                assert [b.length for b in await s.blocks()] == [a.length, 3, 3]
                probs = await s.probe([a], " yes or no? Answer:")
                assert abs(sum(probs.values()) - 1) < 1e-6
                co = await s.start([a, fork], max_tokens=300, stop_at_eos=False)
                await asyncio.sleep(0.2)
                assert (await s.cancel(co["id"]))["finish_reason"] in ("cancelled", "length")
                assert (await s.coroutine(co["id"]))["status"] == "finished"
                assert any(c["kind"] == "probe" for c in await s.coroutines())
                result = await s.generate([a, out], max_tokens=2, stop_at_eos=False)
                assert len(result["token_ids"]) == 2
                await s.delete_block(fork)
                with pytest.raises(ClientError) as err:
                    await s.get_block(fork)
                assert err.value.status == 404
            with pytest.raises(ClientError):
                await s.blocks()  # the session is gone
        async with AsyncClient(server.url, api_key="wrong") as bad:
            with pytest.raises(ClientError) as err:
                await bad.session()
            assert err.value.status == 401

    asyncio.run(main())


def _load_example():
    spec = importlib.util.spec_from_file_location(
        "http_thinker_narrator", ROOT / "examples" / "http_thinker_narrator.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_thinker_narrator_example_runs(server):
    example = _load_example()
    out = io.StringIO()
    result = asyncio.run(
        example.run(
            server.url, api_key="k", think_tokens=24, every=6, narrate_tokens=4, threshold=0.0, out=out
        )
    )
    assert result["thoughts"] and len(result["probes"]) >= 1
    assert len(result["narration"]) == len(result["probes"])  # threshold 0: every probe narrates
    assert all(0 <= p <= 1 for p in result["probes"])
    assert "thoughts:" in out.getvalue()


@pytest.mark.slow
def test_cothink_serve_process(tmp_path):
    """`cothink serve` (add_parser + run) as a subprocess: auth, JSON logs, SIGINT shutdown, --trace-out."""
    trace = tmp_path / "trace.json"
    code = (
        "import argparse, sys\n"
        "from cothink.server import cli\n"
        "p = argparse.ArgumentParser(prog='cothink'); sub = p.add_subparsers()\n"
        "cli.add_parser(sub)\n"
        "args = p.parse_args(sys.argv[1:])\n"
        "sys.exit(args.func(args))\n"
    )
    cmd = [
        sys.executable,
        "-c",
        code,
        "serve",
        "--model",
        str(tiny_chat_model_dir()),
        "--model-name",
        "tiny",
        "--port",
        "0",
        "--api-key",
        "secret",
        "--log-format",
        "json",
        "--trace-out",
        str(trace),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    try:
        url = None
        deadline = time.monotonic() + 180
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            message = json.loads(line).get("message", "")
            if "running on" in message:
                url = message.split("running on ")[1].split()[0]
        assert url, "".join(lines)
        assert httpx.get(url + "/health").json()["status"] == "ok"
        assert httpx.get(url + "/v1/models").status_code == 401
        r = httpx.post(
            url + "/v1/chat/completions",
            headers={"Authorization": "Bearer secret"},
            timeout=60,
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "".join(lines)
    records = [json.loads(x) for x in (lines + rest.splitlines()) if x.strip()]
    assert any(x["logger"].startswith("uvicorn") for x in records)
    assert json.loads(trace.read_text())["traceEvents"]
    assert trace.with_suffix(".png").exists()


def test_serve_parser_defaults():
    from cothink.server import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve"])
    assert (args.host, args.port, args.model, args.log_format, args.trace_out) == (
        "127.0.0.1",
        8000,
        "smollm2",
        "human",
        None,
    )
    settings = cli.settings_from_args(
        parser.parse_args(["serve", "--api-key", "a", "--api-key", "b", "--model", "/x/my-model/"])
    )
    assert settings.api_keys[:2] == ("a", "b") and settings.model_name == "my-model"
    exposed = cli.settings_from_args(
        parser.parse_args(
            ["serve", "--host", "0.0.0.0", "--allowed-hosts", "api.example, x.example", "--admin-key", "z",
             "--allowed-origins", "http://app.example", "--session-idle-s", "0", "--key-memory-share", "0.25"]
        )
    )
    assert exposed.bind_host == "0.0.0.0" and exposed.allowed_hosts == ("api.example", "x.example")
    assert exposed.admin_keys == ("z",) and exposed.allowed_origins == ("http://app.example",)
    assert exposed.session_idle_s is None and exposed.memory_share() == 0.25
