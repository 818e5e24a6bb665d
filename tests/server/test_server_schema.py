"""Property-based API fuzzing with schemathesis against the live server's own OpenAPI schema: no 5xx.

Path ids are mostly swapped for real ones (a live session and its blocks) so the handlers behind the
404s get exercised too. Bounded examples per operation keep the run short.
"""

from __future__ import annotations

import random
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from support import running_server, tiny_engine

from cothink.server import ServerSettings

pytestmark = pytest.mark.slow
KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_EXAMPLES = 12
# an endless Server-Sent Events stream: a fuzzed request would read it until the client's timeout
# (tests/server/test_server_events.py covers its answers)
ENDLESS_STREAMS = frozenset({"/v1/events"})


@pytest.fixture(scope="module")
def live():
    settings = ServerSettings(
        model_name="tiny",
        api_keys=(KEY,),
        max_tokens_per_request=8,
        max_sessions=64,
        session_max_blocks=16,
        session_max_tokens=2000,
    )
    with running_server(tiny_engine(max_input_tokens=512), settings) as srv:
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as http:
            sid = http.post("/v1/sessions", json={"name": "fuzz"}).json()["id"]
            blocks = [
                http.post(f"/v1/sessions/{sid}/blocks", json={"text": t}).json()["id"]
                for t in ("Hello there.", "General Kenobi.")
            ]
        srv.fuzz_ids = {"session_id": sid, "block_id": blocks}
        yield srv


def test_no_server_errors(live):
    """Every operation: up to MAX_EXAMPLES generated requests (positive and negative); none may get a 5xx."""
    api = schemathesis.openapi.from_url(live.url + "/openapi.json", headers=AUTH)
    rng = random.Random(0)
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    operations = 0
    for result in api.get_all_operations():
        op = result.ok()
        if op.path in ENDLESS_STREAMS:
            continue
        operations += 1

        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        @given(
            case=st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))
        )
        def run(case):
            params = case.path_parameters or {}
            if "session_id" in params and not (
                case.method == "DELETE" and case.path == "/v1/sessions/{session_id}"
            ):
                if rng.random() < 0.8:
                    params["session_id"] = live.fuzz_ids["session_id"]
            keep_blocks = case.method == "DELETE" and case.path.endswith("{block_id}")
            if "block_id" in params and not keep_blocks and rng.random() < 0.8:
                params["block_id"] = rng.choice(live.fuzz_ids["block_id"])
            response = case.call(base_url=live.url, headers=AUTH, timeout=60)
            statuses[response.status_code] += 1
            if response.status_code >= 500:
                failures.append(
                    f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}"
                )
            case.validate_response(response, checks=[not_a_server_error])
            if response.status_code >= 400:
                body = response.json()
                assert body["error"]["message"] and body["error"]["type"], body

        run()
    print(f"schemathesis: {operations} operations, statuses {dict(sorted(statuses.items()))}")
    assert operations >= 20
    assert not failures, failures
    assert sum(n for code, n in statuses.items() if code < 300) >= operations  # not only rejections


def test_malformed_bodies_get_4xx_with_a_message(live):
    sid = live.fuzz_ids["session_id"]
    blk = live.fuzz_ids["block_id"][0]
    bodies = [
        b"",
        b"{",
        b"[]",
        b"null",
        b'{"view": "x"}',
        b'{"view": [1, 2]}',
        b'{"max_tokens": "many"}',
        b"\xff\xfe",
        b'{"text": 5}',
        b'{"token_ids": [1.5]}',
        b'{"token_ids": [true]}',
    ]
    paths = [
        "/v1/chat/completions",
        "/v1/completions",
        f"/v1/sessions/{sid}/generate",
        f"/v1/sessions/{sid}/probe",
        f"/v1/sessions/{sid}/blocks/{blk}/extend",
        f"/v1/sessions/{sid}/blocks/{blk}/truncate",
    ]
    with httpx.Client(
        base_url=live.url, headers={**AUTH, "Content-Type": "application/json"}, timeout=60
    ) as http:
        for path in paths:
            for body in bodies:
                r = http.post(path, content=body)
                assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
                assert r.json()["error"]["message"], (path, body)
        # the server still works
        assert http.get("/health").json()["status"] == "ok"
