"""Structured logs that name the session, coroutine and block behind every line.

The engine logs to ``cothink.engine`` with ``extra={"coroutine": ..., "block": ...}``. The server sets the
session and request ids in context variables while it handles a request, and registers which session
each coroutine and block belongs to, so lines the step loop writes (outside any request) still carry
their session.

    from cothink.observability import setup_logging
    setup_logging("json")          # or "human"
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import OrderedDict
from contextvars import ContextVar
from typing import Any, TextIO

__all__ = [
    "ContextFilter",
    "HumanFormatter",
    "JsonFormatter",
    "bind_owner",
    "coroutine_var",
    "forget_owner",
    "request_var",
    "session_var",
    "setup_logging",
]

session_var: ContextVar[str | None] = ContextVar("cothink_session", default=None)
coroutine_var: ContextVar[str | None] = ContextVar("cothink_coroutine", default=None)
request_var: ContextVar[str | None] = ContextVar("cothink_request", default=None)

CONTEXT_FIELDS = ("session", "coroutine", "block", "request")
_OWNERS: OrderedDict[str, str] = OrderedDict()  # coroutine or block name -> session id
_MAX_OWNERS = 200_000
_SCRATCH_SUFFIXES = ("-probe", "-peek")


def bind_owner(name: str, session: str) -> None:
    """Record that the coroutine or block `name` belongs to `session` (for lines logged outside requests)."""
    _OWNERS[name] = session
    _OWNERS.move_to_end(name)
    while len(_OWNERS) > _MAX_OWNERS:
        _OWNERS.popitem(last=False)


def forget_owner(name: str) -> None:
    _OWNERS.pop(name, None)


def _owner(name: str | None) -> str | None:
    if not name:
        return None
    found = _OWNERS.get(name)
    if found is None:
        for suffix in _SCRATCH_SUFFIXES:  # scratch blocks are named after their coroutine
            if suffix in name:
                found = _OWNERS.get(name.split(suffix, 1)[0])
                if found is not None:
                    break
    return found


class ContextFilter(logging.Filter):
    """Fill record.session / coroutine / block / request from context variables and the owner registry."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "session", None) is None:
            record.session = session_var.get()
        if getattr(record, "coroutine", None) is None:
            record.coroutine = coroutine_var.get()
        if getattr(record, "request", None) is None:
            record.request = request_var.get()
        if getattr(record, "block", None) is None:
            record.block = None
        if record.session is None:
            record.session = _owner(record.coroutine) or _owner(record.block)
        return True


_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "color_message",
}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the context ids and any other extras."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in CONTEXT_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        for key, value in record.__dict__.items():
            if key in _RESERVED or key in CONTEXT_FIELDS or key.startswith("_") or key in out:
                continue
            out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class HumanFormatter(logging.Formatter):
    """``time level logger: message [session=.. coroutine=.. block=..]``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = " ".join(f"{k}={getattr(record, k)}" for k in CONTEXT_FIELDS if getattr(record, k, None))
        if ids:
            head, sep, tail = line.partition("\n")  # keep a traceback below the ids
            line = f"{head} [{ids}]{sep}{tail}"
        return line


def setup_logging(
    fmt: str = "human",
    level: int | str = "INFO",
    stream: TextIO | None = None,
    loggers: tuple[str, ...] = ("cothink", "uvicorn"),
) -> logging.Handler:
    """Send the `loggers` (default cothink.* and uvicorn.*) to one handler in `fmt` ('human' or 'json').

    Calling it again replaces the handler it installed before. Returns the handler.
    """
    if fmt not in ("human", "json"):
        raise ValueError("log format must be 'human' or 'json'")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else HumanFormatter())
    handler._cothink = True  # type: ignore[attr-defined]
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
    for name in loggers:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if getattr(h, "_cothink", False)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
    if "uvicorn" in loggers:
        for child in ("uvicorn.error", "uvicorn.access"):  # let them reach the "uvicorn" handler
            sub = logging.getLogger(child)
            for old in [h for h in sub.handlers if getattr(h, "_cothink", False)]:
                sub.removeHandler(old)
            sub.propagate = True
    return handler
