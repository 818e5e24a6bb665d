"""Server settings: limits, quotas and auth (set from `cothink serve` flags or in code)."""

from __future__ import annotations

from dataclasses import dataclass

from cothink.errors import InvalidParameterError
from cothink.server.connections import ConnectionLimits


@dataclass
class ServerSettings:
    """What the HTTP server allows: limits per request, quotas per session and per API key."""

    model_name: str = "cothink"  # the id /v1/models lists and requests must name
    api_keys: tuple[str, ...] = ()  # empty: no auth. Otherwise every route but /health needs a Bearer key
    max_body_bytes: int = 1 << 20  # request bodies above this get 413
    max_tokens_per_request: int = 4096  # max_tokens above this get 400
    default_chat_max_tokens: int = 512  # chat completions without max_tokens
    default_completion_max_tokens: int = 16  # completions without max_tokens (OpenAI's default)
    max_choices: int = 8  # prompts x n per completion request
    max_stop: int = 4  # stop sequences per request
    max_sessions: int = 1024  # live sessions, all keys together
    session_max_blocks: int = 256  # live blocks per session
    session_max_tokens: int = 65_536  # tokens in a session's blocks plus what its running generations may add
    session_max_running: int = 32  # running coroutines (extend, generate, probe) per session
    session_keep_finished: int = 64  # finished coroutines a session remembers for GET .../coroutines
    max_view_blocks: int = 64  # blocks per view
    max_probe_choices: int = 32
    # ---- exposure (docs/server.md, "Threat model") ----
    bind_host: str = "127.0.0.1"  # where the server listens; loopback restricts the accepted Host names
    allowed_hosts: tuple[str, ...] | None = None  # Host names accepted; None: loopback names when bound there
    allowed_origins: tuple[str, ...] = ()  # browser Origins allowed (CORS); others get 403
    admin_keys: tuple[str, ...] = ()  # keys that also see every coroutine in /v1/timeline (also valid keys)
    list_sessions_without_key: bool = False  # without keys, GET /v1/sessions is refused unless this is set
    header_timeout_s: float = 10.0  # a request's head must arrive within this, or the connection is closed
    body_timeout_s: float = 30.0  # a request's body must arrive within this of its head
    max_pending_connections: int = 64  # connections waiting for a request head; one more closes the oldest
    # ---- memory quotas, counted in KV pages (a block costs at least one page) ----
    # share of the KV pool one key may hold; None: 1 / number of keys (admin keys included). The shares of
    # all keys add up to at most 1 (checked), so no key is promised pages another key holds
    key_memory_share: float | None = None
    key_max_sessions: int | None = None  # live sessions per key; None: max_sessions / number of keys
    session_idle_s: float | None = 1800.0  # a session unused this long is deleted (None: never)
    block_idle_s: float | None = None  # a block unused this long is released (None: same as sessions)
    memory_pressure: float = 0.9  # /health reports memory_pressure above this used share of the pool
    prefix_cache_share: float = 0.25  # pool share that cached prompt prefixes may keep (0: no reuse)
    tokenize_inline_chars: int = 4096  # longer texts are tokenized in a worker thread, off the event loop
    # ---- session snapshots (docs/server.md, "Snapshots") ----
    snapshot_dir: str | None = None  # where snapshots are written; None: <cothink cache dir>/snapshots
    key_max_snapshots: int = 32  # snapshots one API key may keep on disk (without keys: all clients)
    key_max_snapshot_bytes: int = 4 << 30  # bytes of snapshots one API key may keep on disk
    snapshot_ttl_s: float | None = 30 * 86_400.0  # snapshots older than this are deleted (None: never)
    # ---- session journal (docs/server.md, "Journal and crash recovery") ----
    journal_dir: str | None = None  # one append-only journal per session here; restored at start. None: off
    journal_sync: str = "interval"  # when records are fsynced: always | interval | never
    journal_sync_interval_s: float = 1.0  # 'interval': a changed journal is fsynced at most this much later
    journal_compact_bytes: int | None = 1 << 20  # a longer session journal is compacted onto a snapshot
    trace_out: str | None = None  # write the step timeline (Chrome JSON + PNG) here at shutdown
    timeline_default_steps: int = 10_000  # GET /v1/timeline returns at most this many recent steps by default

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Refuse settings that promise more than the server has (InvalidParameterError naming the field)."""
        share = self.key_memory_share
        if share is not None:
            if not 0 < share <= 1:
                raise InvalidParameterError(
                    f"key_memory_share must be in (0, 1], got {share:g}", param="key_memory_share"
                )
            n = len(self.keys())
            if n * share > 1 + 1e-9:
                raise InvalidParameterError(
                    f"key_memory_share {share:g} x {n} keys promises {n * share:g} of the KV pool; the "
                    f"keys' shares must add up to at most 1 (at most {1 / n:.4g} each, or leave it unset)",
                    param="key_memory_share",
                )
        if self.key_max_snapshot_bytes < 1 or self.key_max_snapshots < 1:
            raise InvalidParameterError(
                "key_max_snapshots and key_max_snapshot_bytes must be positive",
                param="key_max_snapshot_bytes",
            )
        if self.snapshot_ttl_s is not None and self.snapshot_ttl_s <= 0:
            raise InvalidParameterError(
                f"snapshot_ttl_s must be positive or None, got {self.snapshot_ttl_s:g}",
                param="snapshot_ttl_s",
            )

    def keys(self) -> tuple[str, ...]:
        """Every accepted key (admin keys included)."""
        return tuple(dict.fromkeys((*self.api_keys, *self.admin_keys)))

    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(self.header_timeout_s, self.body_timeout_s, self.max_pending_connections)

    def memory_share(self) -> float:
        """The share of the KV pool one key may hold: all keys' shares together are at most the pool."""
        if self.key_memory_share is not None:
            return self.key_memory_share
        return 1.0 / max(1, len(self.keys()))

    def sessions_per_key(self) -> int:
        if self.key_max_sessions is not None:
            return self.key_max_sessions
        return max(1, self.max_sessions // max(1, len(self.keys())))

    def block_expiry_s(self) -> float | None:
        return self.block_idle_s if self.block_idle_s is not None else self.session_idle_s
