"""Browser fixtures: a real headless Chromium driven by Playwright, a real `cothink serve` on loopback.

The browser is the one `scripts/fetch-chromium` installs into the user cache (the bootstrap runs it);
without it these tests fail, they never skip. Every page records its JavaScript errors (uncaught
exceptions and console errors) and fails its test if there is any. Chromium's own network log lines
("Failed to load resource: ...", written when a request is refused, e.g. 401 before a key is given or
while the server restarts) are not JavaScript errors and are not counted.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from support import smollm2_dir

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"alice": "alice-key", "bob": "bob-key", "root": "root-key"}
CHROMIUM_ARGS = [
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
NETWORK_LOG = "Failed to load resource"


def chromium_executable() -> str:
    """The headless Chromium: $COTHINK_CHROMIUM, else scripts/fetch-chromium (cached, idempotent)."""
    exe = os.environ.get("COTHINK_CHROMIUM")
    if not exe:
        run = subprocess.run(
            [str(ROOT / "scripts" / "fetch-chromium")], capture_output=True, text=True, timeout=600
        )
        lines = run.stdout.strip().splitlines()
        if run.returncode != 0 or not lines:
            pytest.fail(f"no headless Chromium: scripts/fetch-chromium failed:\n{run.stderr}")
        exe = lines[-1]
    if not os.access(exe, os.X_OK):
        pytest.fail(f"no headless Chromium at {exe}: run scripts/fetch-chromium")
    return exe


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """One Chromium per module. Not per session: while the sync Playwright API is open, its event
    loop runs in this thread, and the async tests of later modules could not start theirs."""
    from playwright.sync_api import sync_playwright

    exe = chromium_executable()
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=exe, headless=True, args=CHROMIUM_ARGS, timeout=60_000)
        yield chromium
        chromium.close()


@dataclass
class Pages:
    """Opens pages in fresh contexts; each records its JavaScript errors."""

    browser: object
    errors: list[str] = field(default_factory=list)
    contexts: list[object] = field(default_factory=list)

    def new(self, width: int = 1400, height: int = 1000):
        context = self.browser.new_context(viewport={"width": width, "height": height})
        self.contexts.append(context)
        page = context.new_page()
        page.on("pageerror", lambda exc: self.errors.append(f"page error: {exc}"))

        def on_console(message) -> None:
            if message.type == "error" and not message.text.startswith(NETWORK_LOG):
                self.errors.append(f"console error: {message.text}")

        page.on("console", on_console)
        return page

    def close(self) -> None:
        for context in self.contexts:
            context.close()


@pytest.fixture
def pages(browser) -> Iterator[Pages]:
    """Pages for one test; the test fails if any of them raised a JavaScript error."""
    opened = Pages(browser)
    yield opened
    opened.close()
    assert not opened.errors, opened.errors


def _open_console(page, url: str, key: str | None = None) -> None:
    """Load the console, type the key into its form (as a person would) and wait for the stream."""
    from playwright.sync_api import expect

    page.goto(url + "/console")
    if key is not None:
        page.fill("#key", key)
        page.click("#key-form button")
    expect(page.locator("#connection")).to_have_attribute("data-connection", "live", timeout=30_000)


@pytest.fixture
def open_console():
    """open_console(page, url, key=None): the console page, connected (with the key typed in)."""
    return _open_console


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MAIN = "import sys; from cothink.cli import main; sys.exit(main())"


@dataclass
class Serve:
    """`cothink serve` as a subprocess on a fixed loopback port (so it can be restarted in place)."""

    model: Path
    port: int
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def key(self, who: str) -> str:
        return KEYS[who]

    def client(self, who: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEYS[who]}"}, timeout=60)

    def start(self, timeout: float = 180) -> Serve:
        cmd = [sys.executable, "-c", MAIN, "serve", "--model", str(self.model), "--model-name", "tiny"]
        cmd += ["--port", str(self.port), "--log-level", "warning"]
        cmd += ["--api-key", KEYS["alice"], "--api-key", KEYS["bob"], "--admin-key", KEYS["root"]]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"cothink serve did not start:\n{self.log.read_text()}")

    def stop(self) -> int:
        """SIGINT (a graceful shutdown); returns the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def server() -> Iterator[Serve]:
    folder = Path(tempfile.mkdtemp(prefix="cothink-console-"))
    # SmolLM2 rather than the tiny random model: its generations of LONG tokens outlast the checks a
    # test makes while they run (a lane "running", input marked on it) on any machine, where the tiny
    # model can finish one before the page has drawn it
    serve = Serve(smollm2_dir(), free_port(), folder / "serve.log").start()
    try:
        yield serve
    finally:
        assert serve.stop() == 0, serve.log.read_text()


@pytest.fixture(scope="session")
def artifacts() -> Path:
    """Where screenshots go: $COTHINK_TEST_ARTIFACTS, else <tmp>/cothink-test-artifacts."""
    env = os.environ.get("COTHINK_TEST_ARTIFACTS")
    path = Path(env) if env else Path(tempfile.gettempdir()) / "cothink-test-artifacts"
    path.mkdir(parents=True, exist_ok=True)
    return path
