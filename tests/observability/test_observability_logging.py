"""Structured logs carry the session, coroutine and block ids (JSON and human formats)."""

from __future__ import annotations

import io
import json
import logging

import httpx
import pytest
from support import running_server, tiny_engine

from cothink.observability import setup_logging
from cothink.observability.logs import session_var
from cothink.server import ServerSettings


@pytest.fixture
def restore_loggers():
    saved = {
        name: (
            logging.getLogger(name).handlers[:],
            logging.getLogger(name).level,
            logging.getLogger(name).propagate,
        )
        for name in ("cothink", "uvicorn")
    }
    yield
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


def test_json_logs_carry_session_coroutine_and_block(restore_loggers):
    stream = io.StringIO()
    setup_logging("json", "DEBUG", stream=stream)
    engine = tiny_engine()
    with running_server(engine, ServerSettings(model_name="tiny")) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            sid = http.post("/v1/sessions").json()["id"]
            blk = http.post(f"/v1/sessions/{sid}/blocks", json={"text": "hello"}).json()["id"]
            out = http.post(f"/v1/sessions/{sid}/blocks").json()["id"]
            co = http.post(
                f"/v1/sessions/{sid}/generate",
                json={"view": [blk, out], "max_tokens": 500, "background": True},
            ).json()["id"]
            http.post(f"/v1/sessions/{sid}/coroutines/{co}/cancel")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines and all({"time", "level", "logger", "message"} <= set(x) for x in lines)
    submits = [x for x in lines if x["logger"] == "cothink.engine" and x["message"].startswith("submit")]
    assert {x["coroutine"] for x in submits} >= {co}
    mine = [x for x in submits if x["coroutine"] == co]
    assert mine[0]["session"] == sid and mine[0]["block"] == out
    # the cancel is logged from the step loop or the cancel request; either way it names the session
    cancelled = [x for x in lines if x["logger"] == "cothink.engine" and x["message"].startswith("cancelled")]
    assert cancelled and cancelled[0]["session"] == sid and cancelled[0]["coroutine"] == co
    assert any(x["logger"] == "cothink.server" and x.get("session") == sid for x in lines)


def test_human_format(restore_loggers):
    stream = io.StringIO()
    setup_logging("human", "INFO", stream=stream)
    token = session_var.set("sess_demo")
    try:
        logging.getLogger("cothink.engine").info("hello", extra={"coroutine": "co_1", "block": "blk_1"})
    finally:
        session_var.reset(token)
    line = stream.getvalue().strip()
    assert "INFO" in line and "cothink.engine: hello" in line
    assert line.endswith("[session=sess_demo coroutine=co_1 block=blk_1]")
    with pytest.raises(ValueError):
        setup_logging("xml")
