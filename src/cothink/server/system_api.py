"""System routes: liveness, Prometheus metrics and the step timeline (docs/server.md)."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from cothink.observability.metrics import CONTENT_TYPE
from cothink.observability.timeline import chrome_trace
from cothink.ops import native
from cothink.server.errors import ERROR_RESPONSES
from cothink.server.schemas import Health, KernelHealth
from cothink.server.state import ServerState, get_state

if TYPE_CHECKING:
    from cothink.runtime.engine import StepRecord

router = APIRouter(tags=["system"])


@router.get(
    "/health",
    response_model=Health,
    summary="Liveness (no API key needed)",
    responses={503: {"model": Health, "description": "Draining, or the engine's step loop stopped"}},
)
async def health(state: ServerState = Depends(get_state)) -> Response:
    engine = state.engine
    if state.draining:
        status = "draining"
    else:
        status = "ok" if engine.running else "engine_stopped"
    memory = state.memory() if engine.running else None
    if status == "ok" and memory is not None and memory["pressure"]:
        status = "memory_pressure"
    # cached: built when the runner loaded or the engine started
    kernels = KernelHealth(**asdict(native.status()))
    body = Health(
        status=status, engine_running=engine.running, steps=engine.steps, memory=memory, kernels=kernels
    )
    code = 200 if status in ("ok", "memory_pressure") else 503
    return JSONResponse(body.model_dump(), status_code=code)


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    responses={
        200: {"content": {"text/plain": {}}, "description": "Prometheus text format"},
        401: ERROR_RESPONSES[401],
    },
)
async def metrics(state: ServerState = Depends(get_state)) -> Response:
    return Response(state.metrics.exposition(), media_type=CONTENT_TYPE)


@router.get(
    "/v1/timeline",
    summary="Recent engine steps as a Chrome/Perfetto trace",
    responses={
        200: {
            "content": {"application/json": {}},
            "description": "Chrome trace JSON: one track per coroutine, one X event per step item",
        },
        401: ERROR_RESPONSES[401],
    },
)
async def timeline(
    request: Request,
    state: ServerState = Depends(get_state),
    steps: int | None = Query(None, ge=1, le=1_000_000, description="How many recent steps (default 10000)"),
) -> Response:
    records = list(state.engine.timeline)
    records = records[-(steps or state.settings.timeline_default_steps) :]
    if request.scope.get("cothink.admin") is not True:
        records = own_items(records, state, request.scope.get("cothink.principal", "anonymous"))
    return JSONResponse(chrome_trace(records))


def own_items(records: list[StepRecord], state: ServerState, me: str) -> list[StepRecord]:
    """The timeline a non-admin caller sees: its own coroutines by name; everyone else's items are
    kept (load is not a secret) under the one lane 'others', with no ids."""
    out = []
    for record in records:
        items = tuple(
            item if state.owners.get(item.coroutine) == me else replace(item, coroutine="others")
            for item in record.items
        )
        out.append(replace(record, items=items))
    return out
