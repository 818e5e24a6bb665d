"""Server settings: limits, quotas and auth (set from `cothink serve` flags or in code)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerSettings:
    """What the HTTP server allows. Quotas are per session; limits are per request."""

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
    trace_out: str | None = None  # write the step timeline (Chrome JSON + PNG) here at shutdown
    timeline_default_steps: int = 10_000  # GET /v1/timeline returns at most this many recent steps by default
