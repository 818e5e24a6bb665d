"""`cothink serve`: run the HTTP server (wired into cothink.cli with add_parser / run)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from cothink.cli import DEFAULT_MODEL, QUANTIZE_MODES


def _byte_count(text: str) -> int:
    from cothink.memory.store import parse_bytes

    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert value is not None
    return value


def _byte_count_or_zero(text: str) -> int:
    return 0 if text.strip() == "0" else _byte_count(text)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    from cothink.server.settings import ServerSettings

    d = ServerSettings()
    p = subparsers.add_parser(
        "serve",
        help="run the HTTP server (OpenAI-compatible API and the session API)",
        description="Serve MODEL over HTTP: OpenAI-compatible /v1/completions and /v1/chat/completions, a "
        "session API for blocks and coroutines (/v1/sessions), /health, /metrics (Prometheus) and "
        "/v1/timeline. Binds 127.0.0.1 unless told otherwise. See docs/server.md.",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="PATH_OR_NAME",
        help=f"embedded model name or a Hugging Face model folder (default: {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--model-name",
        default=None,
        help="model id clients send and /v1/models lists (default: the model's name)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 = any free port)")
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health; repeat for several "
        "keys (also COTHINK_API_KEY)",
    )
    p.add_argument(
        "--log-format", choices=("human", "json"), default="human", help="log format (default: human)"
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument(
        "--trace-out",
        default=None,
        metavar="FILE",
        help="at shutdown, write the step timeline as a Chrome trace (FILE, .json) and a PNG next to it",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument(
        "--quantize", choices=QUANTIZE_MODES, default=None,
        help="weight-only int8 or 4-bit linears (Llama, Qwen2, Qwen3)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-tokens", type=_positive, default=None, help="KV pool size in tokens")
    p.add_argument("--max-tokens-per-request", type=_positive, default=d.max_tokens_per_request)
    p.add_argument("--max-body-bytes", type=_positive, default=d.max_body_bytes)
    p.add_argument("--max-sessions", type=_positive, default=d.max_sessions)
    p.add_argument("--session-max-blocks", type=_positive, default=d.session_max_blocks)
    p.add_argument("--session-max-tokens", type=_positive, default=d.session_max_tokens)
    p.add_argument("--session-max-running", type=_positive, default=d.session_max_running)
    p.add_argument(
        "--admin-key",
        action="append",
        default=None,
        metavar="KEY",
        help="a key that also sees every coroutine in /v1/timeline (repeatable)",
    )
    p.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="NAMES",
        help="comma-separated Host names to accept (default: loopback names when bound to loopback)",
    )
    p.add_argument(
        "--allowed-origins",
        default="",
        metavar="ORIGINS",
        help="comma-separated browser origins allowed (CORS), e.g. http://localhost:3000; others get 403",
    )
    p.add_argument(
        "--key-memory-share",
        type=float,
        default=None,
        help="share of the KV pool one API key may hold (default: 1 / number of keys, admin keys "
        "included); the keys' shares may add up to at most 1",
    )
    p.add_argument("--key-max-sessions", type=_positive, default=None, help="live sessions per key")
    p.add_argument(
        "--session-idle-s",
        type=float,
        default=d.session_idle_s,
        help=f"delete sessions unused this long, in seconds (default {d.session_idle_s:g}; 0 = never)",
    )
    p.add_argument(
        "--block-idle-s",
        type=float,
        default=None,
        help="release blocks unused this long, in seconds (default: as sessions)",
    )
    p.add_argument(
        "--memory-budget",
        default=None,
        metavar="BYTES",
        help="bound all block memory (KV pages and GDN records), e.g. 2GiB; blocks no work reads are "
        "spilled to disk beyond it (docs/runtime.md, \"Memory\")",
    )
    p.add_argument(
        "--snapshot-dir",
        default=None,
        metavar="DIR",
        help="where POST /v1/sessions/{id}/snapshot writes (default: <cache dir>/snapshots)",
    )
    p.add_argument(
        "--key-max-snapshots",
        type=_positive,
        default=d.key_max_snapshots,
        help=f"snapshots one API key may keep (default {d.key_max_snapshots})",
    )
    p.add_argument(
        "--key-max-snapshot-bytes",
        type=_byte_count,
        default=d.key_max_snapshot_bytes,
        metavar="BYTES",
        help="bytes of snapshots one API key may keep on disk, e.g. 512MiB "
        f"(default {d.key_max_snapshot_bytes >> 30}GiB)",
    )
    p.add_argument(
        "--snapshot-ttl-s",
        type=float,
        default=d.snapshot_ttl_s,
        metavar="S",
        help="delete snapshots older than S seconds (default "
        f"{d.snapshot_ttl_s:.0f}, i.e. 30 days; 0 = never)",
    )
    p.add_argument(
        "--header-timeout-s",
        type=float,
        default=d.header_timeout_s,
        help=f"close a connection whose request head takes longer (default {d.header_timeout_s:g})",
    )
    p.add_argument(
        "--body-timeout-s",
        type=float,
        default=d.body_timeout_s,
        help=f"close a connection whose request body takes longer (default {d.body_timeout_s:g})",
    )
    p.add_argument(
        "--max-pending-connections",
        type=_positive,
        default=d.max_pending_connections,
        help="connections that may wait for a request head at once; one more closes the oldest "
        f"(default {d.max_pending_connections})",
    )
    p.add_argument(
        "--journal-dir",
        default=None,
        metavar="DIR",
        help="journal every session change to DIR (one file per session) before it is acknowledged, "
        "and restore every journaled session at start (docs/server.md, \"Journal and crash recovery\")",
    )
    p.add_argument(
        "--journal-sync",
        choices=("always", "interval", "never"),
        default=d.journal_sync,
        help="when journal records are fsynced: always (before each acknowledgment; a machine crash "
        "loses nothing), interval (within 1 s; a machine crash loses at most the last second), never "
        "(left to the OS). A crash of the server process alone loses nothing in any mode "
        f"(default {d.journal_sync})",
    )
    p.add_argument(
        "--journal-compact-bytes",
        type=_byte_count_or_zero,
        default=d.journal_compact_bytes,
        metavar="BYTES",
        help="compact a session's journal onto a snapshot of its blocks once it grows past BYTES, so "
        f"restoring it stays fast (default {(d.journal_compact_bytes or 0) >> 20}MiB; 0 = never)",
    )
    p.add_argument(
        "--record",
        default=None,
        metavar="FILE",
        help="record every engine call and step to FILE, for `cothink replay FILE` (docs/runtime.md)",
    )
    p.set_defaults(func=run)
    return p


def settings_from_args(args: argparse.Namespace):
    from cothink.server.settings import ServerSettings

    keys = list(args.api_key or [])
    env_key = os.environ.get("COTHINK_API_KEY")
    if env_key:
        keys.append(env_key)
    name = args.model_name or Path(str(args.model).rstrip("/")).name or str(args.model)
    return ServerSettings(
        model_name=name,
        api_keys=tuple(keys),
        max_body_bytes=args.max_body_bytes,
        max_tokens_per_request=args.max_tokens_per_request,
        max_sessions=args.max_sessions,
        session_max_blocks=args.session_max_blocks,
        session_max_tokens=args.session_max_tokens,
        session_max_running=args.session_max_running,
        trace_out=args.trace_out,
        bind_host=args.host,
        admin_keys=tuple(args.admin_key or ()),
        allowed_hosts=_names(args.allowed_hosts) if args.allowed_hosts is not None else None,
        allowed_origins=_names(args.allowed_origins),
        key_memory_share=args.key_memory_share,
        key_max_sessions=args.key_max_sessions,
        session_idle_s=args.session_idle_s or None,
        block_idle_s=args.block_idle_s or None,
        snapshot_dir=args.snapshot_dir,
        key_max_snapshots=args.key_max_snapshots,
        key_max_snapshot_bytes=args.key_max_snapshot_bytes,
        snapshot_ttl_s=args.snapshot_ttl_s or None,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        max_pending_connections=args.max_pending_connections,
        journal_dir=args.journal_dir,
        journal_sync=args.journal_sync,
        journal_compact_bytes=args.journal_compact_bytes or None,
    )


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def run(args: argparse.Namespace) -> int:
    import torch

    from cothink.errors import CothinkError
    from cothink.observability import configure_tracing, setup_logging
    from cothink.runtime.engine import Engine
    from cothink.server.app import create_app
    from cothink.server.runner import serve

    setup_logging(args.log_format, args.log_level)
    log = logging.getLogger("cothink.server")
    try:
        settings = settings_from_args(args)
    except ValueError as exc:  # settings that promise more than the server has (InvalidParameterError)
        log.error("cothink serve: %s", exc)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1") and not settings.keys():
        log.warning(
            "binding %s without an API key: anyone who can reach this port can use the model", args.host
        )
    provider = configure_tracing()
    limits = {"kv_tokens": args.kv_tokens} if args.kv_tokens else {}
    if args.quantize:
        limits["quantize"] = args.quantize
    if args.memory_budget:
        limits["memory_budget"] = args.memory_budget
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    log.info("loading model %s", args.model)
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=dtype, **limits)
    if args.record:
        from cothink.runtime.recorder import Recorder

        engine = Recorder(engine, args.record, model=args.model, quantize=args.quantize)
    try:
        app = create_app(engine, settings)
    except CothinkError as exc:  # e.g. a journal directory that cannot be used
        log.error("cothink serve: %s", exc)
        return 2
    try:
        serve(app, args.host, args.port, log_level=args.log_level)
    finally:
        if provider is not None:
            provider.shutdown()
    return 0
