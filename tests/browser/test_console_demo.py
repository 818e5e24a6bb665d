"""`cothink demo --console`: the demo's thinker, narrator and user in the console, and a screenshot."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from playwright.sync_api import expect
from support import tiny_chat_model_dir

pytestmark = pytest.mark.timeout(300)

MAIN = "import sys; from cothink.cli import main; sys.exit(main())"


def _terminal_ctrl_c() -> None:
    """In the child before exec: SIGINT delivered and handled by default, as in a terminal, whatever
    this test process inherited or blocked (a signal mask and an ignored disposition survive exec)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow  # its own process: a model load and the whole demo
def test_the_demo_in_the_console(pages, artifacts):
    cmd = [sys.executable, "-c", MAIN, "demo", "--console", "--port", "0", "--no-live"]
    cmd += ["--model", str(tiny_chat_model_dir()), "--max-tokens", "40", "--narrate-every", "8"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, preexec_fn=_terminal_ctrl_c
    )
    lines: list[str] = []
    try:
        url = None
        deadline = time.monotonic() + 180
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("console: "):
                url = line.split()[1]
        assert url and url.endswith("/console"), "".join(lines)

        page = pages.new(1400, 900)
        page.goto(url)  # the demo starts once the page is connected
        expect(page.locator("#connection")).to_have_attribute("data-connection", "live", timeout=30_000)
        thinker, narrator = (
            page.locator('.lane[data-coroutine="thinker"]'),
            page.locator('.lane[data-coroutine="narrator"]'),
        )
        expect(thinker).to_have_attribute("data-state", "done", timeout=120_000)
        expect(narrator).to_have_attribute("data-state", "done", timeout=60_000)
        # the user's interjection lands in ctx, which the thinker reads
        expect(thinker.locator("mark[data-input]")).not_to_have_count(0)
        expect(narrator.locator("mark[data-probe]")).not_to_have_count(0)
        expect(page.locator('.lane[data-coroutine="user"]')).to_have_count(1)
        # each of the thinker's tokens took a forward pass of its own
        tokens = int(thinker.get_attribute("data-tokens") or 0)
        assert tokens > 0 and page.locator("[data-timeline] [data-step]").count() >= tokens
        assert len(thinker.locator('[data-role="text"]').text_content() or "") > 0
        time.sleep(1.2)  # one more sparkline tick
        shot = artifacts / "console-demo.png"
        png = page.screenshot(path=str(shot), full_page=True)
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        print(f"screenshot: {shot}")

        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        lines.append(rest)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert "[thinker]" in out and "re-encoded" in out
