"""The session API: blocks, views, generations, probes and coroutines, over HTTP, SSE and WebSocket.

One router under /v1/sessions, by resource: sessions (`session_routes`), blocks (`block_routes`),
coroutines (`coroutine_routes`: generate and probe, with their SSE stream), snapshots
(`snapshot_routes`) and the WebSocket (`socket_routes`). Every extend, generation and probe is entered
through `coroutines.coroutine_entry`; what the routes share is in `session_http`.
"""

from __future__ import annotations

from fastapi import APIRouter

from cothink.server import block_routes, coroutine_routes, session_routes, snapshot_routes, socket_routes

# each part's router carries the /v1/sessions prefix itself, so the route a request matched (which
# the request metrics label by) names the whole path. Snapshots come first: GET /v1/sessions/snapshots
# must match before GET /v1/sessions/{session_id} would take "snapshots" for a session id.
router = APIRouter()
for part in (snapshot_routes, session_routes, block_routes, coroutine_routes, socket_routes):
    router.include_router(part.router)
