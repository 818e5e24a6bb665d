"""Coroutine routes: generate (JSON, SSE or in the background) and probe over a view; list, read and
cancel a session's coroutines."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from cothink.server.coroutines import Running, do_probe, start_generation
from cothink.server.errors import APIError
from cothink.server.schemas import (
    CoroutineInfo,
    CoroutineList,
    GenerateRequest,
    GenerateResult,
    ProbeRequest,
    ProbeResult,
)
from cothink.server.session_http import CoroutineIdPath, coroutine_info, errors_doc, get_session
from cothink.server.sessions import Session
from cothink.server.state import ServerState, get_state
from cothink.server.streaming import EventStream, abort_on_disconnect, cancel_on_disconnect, sse

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


def event_stream(state: ServerState, running: Running) -> EventStream:
    """A generation's events as server-sent events, counted as an open stream while they last; the
    client leaving cancels the generation."""

    async def body() -> AsyncIterator[str]:
        state.streams_gauge.inc()
        try:
            async for event in running.events():
                yield sse(event)
        finally:
            state.streams_gauge.dec()

    return EventStream(body(), on_disconnect=running.gen.cancel)


@router.post(
    "/{session_id}/generate",
    response_model=GenerateResult,
    summary="Generate over a view",
    description="Generates into the view's last block. `stream` (default): SSE events `start`, "
    "`token`..., `end` (or `error`); leaving the stream cancels the generation. "
    "`background`: 202 with the coroutine, follow it with GET .../coroutines/{id}.",
    responses={
        **errors_doc(409, 413, 429, 503),
        200: {
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
            "description": "JSON result, or SSE events when stream",
        },
        202: {"model": CoroutineInfo, "description": "Started in the background"},
    },
)
async def generate(
    request: Request,
    body: GenerateRequest,
    session: Session = Depends(get_session),
    state: ServerState = Depends(get_state),
):
    running = start_generation(state, session, body)
    if body.background:

        async def consume() -> None:
            async for _ in running.events():
                pass

        running.co.task = asyncio.create_task(consume(), name=f"cothink-{running.co.id}")
        return JSONResponse(coroutine_info(running.co).model_dump(), status_code=202)
    if body.stream:
        return event_stream(state, running)
    async with cancel_on_disconnect(request, running.gen.cancel):
        last = await running.collect()
    if running.error is not None:
        raise running.error
    return GenerateResult(
        coroutine=running.co.id,
        text=last["text"],
        token_ids=last["token_ids"],
        finish_reason=last["finish_reason"],
        usage=last["usage"],
    )


@router.post(
    "/{session_id}/probe",
    response_model=ProbeResult,
    summary="Probe a view",
    description="Reads `question` after the view in a scratch block and returns the probability of "
    "each choice from one forward pass (single-token choices). Nothing is written.",
    responses=errors_doc(413, 429, 503),
)
async def probe(
    request: Request,
    body: ProbeRequest,
    session: Session = Depends(get_session),
    state: ServerState = Depends(get_state),
) -> ProbeResult:
    async with abort_on_disconnect(request):
        return await do_probe(state, session, body)


@router.get(
    "/{session_id}/coroutines",
    response_model=CoroutineList,
    summary="The session's coroutines",
    responses=errors_doc(),
)
async def list_coroutines(
    session: Session = Depends(get_session),
    status: str = Query(
        "all", pattern="^(all|running)$", description="'running' or 'all' (recent finished ones too)"
    ),
) -> CoroutineList:
    items = session.coroutines.values()
    return CoroutineList(data=[coroutine_info(c) for c in items if status == "all" or c.running])


@router.get(
    "/{session_id}/coroutines/{coroutine_id}",
    response_model=CoroutineInfo,
    summary="One coroutine",
    responses=errors_doc(),
)
async def get_coroutine(
    coroutine_id: str = CoroutineIdPath, session: Session = Depends(get_session)
) -> CoroutineInfo:
    return coroutine_info(session.coroutine(coroutine_id))


@router.post(
    "/{session_id}/coroutines/{coroutine_id}/cancel",
    response_model=CoroutineInfo,
    summary="Cancel a running generation",
    description="The generation stops before its next step with finish reason 'cancelled'; what it "
    "wrote stays in its block. Cancelling a finished coroutine changes nothing.",
    responses=errors_doc(409),
)
async def cancel_coroutine(
    coroutine_id: str = CoroutineIdPath, session: Session = Depends(get_session)
) -> CoroutineInfo:
    co = session.coroutine(coroutine_id)
    if co.kind != "generate" and co.running:
        raise APIError(
            409,
            f"only generations can be cancelled; this coroutine is a running {co.kind}",
            "conflict_error",
            "not_cancellable",
        )
    if co.cancel():
        for _ in range(200):  # let its consumer record the final state (a few event-loop turns)
            if not co.running:
                break
            await asyncio.sleep(0.005)
    return coroutine_info(co)
