"""The session API: blocks, views, generations, probes and coroutines, over HTTP, SSE and WebSocket."""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Body, Depends, Path, Query, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse
from opentelemetry import trace
from pydantic import TypeAdapter, ValidationError

from cothink.errors import SnapshotError
from cothink.observability.logs import coroutine_var, session_var
from cothink.server.openai_features import structured_for
from cothink.server.errors import ERROR_RESPONSES, APIError, from_exception, validation_error
from cothink.server.schemas import (
    BlockCreate,
    BlockInfo,
    BlockList,
    CoroutineInfo,
    CoroutineList,
    Deleted,
    ExtendRequest,
    ForkRequest,
    GenerateRequest,
    GenerateResult,
    ProbeRequest,
    ProbeResult,
    RestoredSession,
    RestoreRequest,
    SessionCreate,
    SessionInfo,
    SnapshotBlockInfo,
    SnapshotCreate,
    SnapshotInfo,
    TruncateRequest,
    WsCancel,
    WsExtend,
    WsGenerate,
    WsMessage,
    WsProbe,
)
from cothink.server.sessions import BlockEntry, CoroutineEntry, Session
from cothink.server.snapshots import BLOCKS_FILE, SnapshotBlock, SnapshotManifest
from cothink.server.streaming import EventStream, abort_on_disconnect, cancel_on_disconnect
from cothink.server.state import ServerState, get_state, get_ws_state, principal

log = logging.getLogger("cothink.server")
router = APIRouter(prefix="/v1/sessions", tags=["sessions"])

SessionId = Path(..., min_length=1, max_length=64, description="Session id")
BlockIdPath = Path(..., min_length=1, max_length=64, description="Block id (of this session)")
CoroutineIdPath = Path(..., min_length=1, max_length=64, description="Coroutine id (of this session)")


def _errors(*codes: int) -> dict:
    return {c: ERROR_RESPONSES[c] for c in (400, 401, 404, *codes)}


async def get_session(request: Request, session_id: str = SessionId) -> Session:
    session = request.app.state.cothink.sessions.get(session_id, principal(request))
    session_var.set(session.id)
    return session


# ---------------------------------------------------------------------------------------- views


def session_info(session: Session) -> SessionInfo:
    return SessionInfo(
        id=session.id,
        name=session.name,
        created=session.created,
        usage=session.usage(),
        limits=session.limits(),
    )


def block_info(
    state: ServerState, session: Session, entry: BlockEntry, text: bool = True, token_ids: bool = False
) -> BlockInfo:
    block = entry.block
    writer = session.writer(entry)
    return BlockInfo(
        id=entry.id,
        name=entry.name,
        length=block.length,
        created=entry.created,
        writer=writer.id if writer else None,
        text=state.decode(block.tokens) if text else None,
        token_ids=list(block.tokens) if token_ids else None,
    )


def coroutine_info(co: CoroutineEntry) -> CoroutineInfo:
    return CoroutineInfo(
        id=co.id,
        name=co.name,
        kind=co.kind,
        status=co.status,
        block=co.block,
        view=co.view,
        created=co.created,
        finish_reason=co.finish_reason,
        text=co.text if co.kind == "generate" else None,
        tokens=len(co.token_ids),
        error=co.error,
    )


# ---------------------------------------------------------------------------------------- operations


async def input_ids(state: ServerState, text: str | None, token_ids: list[int] | None) -> list[int]:
    """The tokens of an extend's input (text tokenized off the event loop when large)."""
    param = "text" if text is not None else "token_ids"
    ids = await state.encode(text, "text") if text is not None else list(token_ids or [])
    if not ids:
        raise APIError(400, "the input is empty", "invalid_request_error", "empty_input", param)
    state.check_token_ids(ids, param)
    return ids


async def do_extend(
    state: ServerState,
    session: Session,
    entry: BlockEntry,
    ids: list[int],
    view_ids: list[str] | None = None,
    priority: str | None = None,
    name: str | None = None,
) -> None:
    state.check_open()
    view = session.view(view_ids) if view_ids is not None else [entry]
    if view[-1] is not entry:
        raise APIError(
            400,
            "the view must end with the block being extended",
            "invalid_request_error",
            "invalid_view",
            "view",
        )
    reservation = session.reserve(entry, len(ids))
    try:
        co = session.new_coroutine("extend", name, [v.id for v in view], entry.id)
    except BaseException:
        reservation.release()
        raise
    co.reservation = reservation
    state.own(co.id, session.account)
    coroutine_var.set(co.id)
    span = state.tracer.start_span(
        "cothink.session.extend",
        attributes={
            "cothink.session": session.id,
            "cothink.coroutine": co.id,
            "cothink.block": entry.id,
            "cothink.view": [v.id for v in view],
            "cothink.tokens": len(ids),
        },
    )
    try:
        with trace.use_span(span, end_on_exit=False):  # the work's span nests under this one
            await state.wait(
                state.engine.extend(
                    entry.block,
                    token_ids=ids,
                    view=[v.block for v in view],
                    priority=priority,
                    name=co.id,
                )
            )
        session.finish(co, "finished", "done")
    except APIError as exc:
        session.finish(co, "failed", error=exc.message)
        span.set_attribute("cothink.error", exc.message)
        raise
    except BaseException:
        session.finish(co, "failed", error="cancelled")
        raise
    finally:
        span.end()


def _stop_list(state: ServerState, stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > state.settings.max_stop:
        raise APIError(
            400,
            f"at most {state.settings.max_stop} stop sequences",
            "invalid_request_error",
            "too_many_stop",
            "stop",
        )
    return [s for s in stops if s]


class Running:
    """A started session generation: its coroutine entry, engine Generation and span."""

    def __init__(
        self, state: ServerState, session: Session, co: CoroutineEntry, gen, span, prompt_tokens: int
    ):
        self.state, self.session, self.co, self.gen, self.span = state, session, co, gen, span
        self.prompt_tokens = prompt_tokens
        self.error: APIError | None = None

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """start, token..., then end (or error). Leaving early cancels the generation."""
        co, session = self.co, self.session
        yield {"type": "start", "coroutine": co.id, "block": co.block, "view": co.view}
        try:
            tail = ""  # the engine's last piece: text flushed at the end, without token ids
            async for piece in self.gen:
                co.text += piece.text
                if not piece.token_ids:
                    tail += piece.text
                    continue
                co.token_ids.extend(piece.token_ids)
                event = {
                    "type": "token",
                    "coroutine": co.id,
                    "text": piece.text,
                    "token_ids": list(piece.token_ids),
                }
                if piece.logprobs:
                    event["logprobs"] = [
                        {"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                        for lp in piece.logprobs
                    ]
                yield event
            result = self.gen.result
            # The token that ended the generation (the last one, or a stop token) comes with the result,
            # not in a piece: send it with the flushed text, so token events add up to the result.
            missing = list(result.token_ids[len(co.token_ids) :])
            if missing or tail:
                yield {"type": "token", "coroutine": co.id, "text": tail, "token_ids": missing}
            co.text, co.token_ids = result.text, list(result.token_ids)
            session.finish(co, "finished", result.finish_reason)
            self.span.set_attribute("cothink.finish_reason", result.finish_reason)
            yield {
                "type": "end",
                "coroutine": co.id,
                "finish_reason": result.finish_reason,
                "text": result.text,
                "token_ids": list(result.token_ids),
                "usage": {
                    "prompt_tokens": self.prompt_tokens,
                    "completion_tokens": len(result.token_ids),
                    "total_tokens": self.prompt_tokens + len(result.token_ids),
                },
            }
        except Exception as exc:
            err = self.error = from_exception(exc)
            session.finish(co, "failed", "error", err.message)
            self.span.set_attribute("cothink.error", err.message)
            yield {"type": "error", "coroutine": co.id, **err.body()}
        finally:
            if co.running:  # the consumer left early
                self.gen.cancel()
                session.finish(co, "finished", "cancelled")
            self.span.set_attribute("cothink.completion_tokens", len(co.token_ids))
            self.span.end()

    async def collect(self) -> dict[str, Any]:
        last: dict[str, Any] = {}
        async for event in self.events():
            last = event
        return last


def start_generation(state: ServerState, session: Session, req: GenerateRequest) -> Running:
    state.check_open()
    view = session.view(req.view)
    if req.max_tokens > state.settings.max_tokens_per_request:
        raise APIError(
            400,
            f"max_tokens is {req.max_tokens}; this server allows at most "
            f"{state.settings.max_tokens_per_request}",
            "invalid_request_error",
            "max_tokens_too_large",
            "max_tokens",
        )
    stops = _stop_list(state, req.stop)
    state.check_token_ids(req.stop_token_ids or [], "stop_token_ids")
    state.check_token_ids(req.banned_token_ids or [], "banned_token_ids")
    state.check_context(sum(v.block.length for v in view), req.max_tokens)
    reservation = session.reserve(view[-1], req.max_tokens)
    try:
        co = session.new_coroutine("generate", req.name, [v.id for v in view], view[-1].id, req.max_tokens)
    except BaseException:
        reservation.release()
        raise
    co.reservation = reservation
    state.own(co.id, session.account)
    coroutine_var.set(co.id)
    span = state.tracer.start_span(
        "cothink.session.generate",
        attributes={
            "cothink.session": session.id,
            "cothink.coroutine": co.id,
            "cothink.block": view[-1].id,
            "cothink.view": [v.id for v in view],
            "cothink.max_tokens": req.max_tokens,
        },
    )
    try:
        structured = structured_for(state, req.response_format, [], None)
        with trace.use_span(span, end_on_exit=False):
            gen = state.call(
                state.engine.generate,
                [v.block for v in view],
                max_tokens=req.max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                seed=req.seed,
                stop=stops or None,
                stop_token_ids=req.stop_token_ids,
                banned_token_ids=req.banned_token_ids,
                priority=req.priority,
                name=co.id,
                stop_at_eos=req.stop_at_eos,
                logprobs=req.logprobs,
                constraint=structured.make_constraint() if structured.make_constraint else None,
            )
    except APIError as exc:
        session.finish(co, "failed", "error", exc.message)
        span.end()
        raise
    co.generation = gen
    return Running(state, session, co, gen, span, sum(v.block.length for v in view))


async def do_probe(state: ServerState, session: Session, req: ProbeRequest) -> ProbeResult:
    state.check_open()
    view = session.view(req.view)
    if isinstance(req.question, str):
        question: list[int] = await state.encode(req.question, "question")
        if not question:
            raise APIError(400, "the question is empty", "invalid_request_error", "empty_input", "question")
    else:
        question = list(req.question)
        state.check_token_ids(question, "question")
    if len(set(req.choices)) != len(req.choices):
        raise APIError(400, "choices must be distinct", "invalid_request_error", "invalid_value", "choices")
    if len(req.choices) > state.settings.max_probe_choices:
        raise APIError(
            400,
            f"at most {state.settings.max_probe_choices} choices",
            "invalid_request_error",
            "too_many_choices",
            "choices",
        )
    co = session.new_coroutine("probe", req.name, [v.id for v in view], None)
    state.own(co.id, session.account)
    coroutine_var.set(co.id)
    span = state.tracer.start_span(
        "cothink.session.probe",
        attributes={
            "cothink.session": session.id,
            "cothink.coroutine": co.id,
            "cothink.view": [v.id for v in view],
            "cothink.choices": list(req.choices),
        },
    )
    try:
        with trace.use_span(span, end_on_exit=False):
            probs = await state.wait(
                state.engine.probe(
                    [v.block for v in view], question, tuple(req.choices), priority=req.priority, name=co.id
                )
            )
        answer = max(probs, key=probs.get)
        session.finish(co, "finished", "done")
        co.text = answer
        span.set_attribute("cothink.answer", answer)
        return ProbeResult(coroutine=co.id, probabilities=probs, answer=answer)
    except APIError as exc:
        session.finish(co, "failed", error=exc.message)
        raise
    except BaseException:
        session.finish(co, "failed", error="cancelled")
        raise
    finally:
        span.end()


def _sse(event: dict) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


# ---------------------------------------------------------------------------------------- sessions


@router.post(
    "", status_code=201, response_model=SessionInfo, summary="Create a session", responses=_errors(413, 429)
)
async def create_session(
    request: Request, body: SessionCreate | None = Body(None), state: ServerState = Depends(get_state)
) -> SessionInfo:
    state.check_open()
    session = state.sessions.create(principal(request), body.name if body else None)
    session_var.set(session.id)
    log.info("session created")
    return session_info(session)


@router.get(
    "",
    response_model=list[SessionInfo],
    summary="Your sessions",
    description="Needs an API key: without keys every caller is the same anonymous principal, so a list "
    "would show other clients' sessions (403 unless the server allows it).",
    responses=_errors(403),
)
async def list_sessions(request: Request, state: ServerState = Depends(get_state)) -> list[SessionInfo]:
    if not state.settings.keys() and not state.settings.list_sessions_without_key:
        raise APIError(
            403,
            "listing sessions needs an API key: without keys a session is reachable only through the "
            "id returned when it was created",
            "permission_error",
            "listing_disabled",
        )
    me = principal(request)
    return [session_info(s) for s in state.sessions.sessions.values() if s.owner == me and not s.closed]


@router.get(
    "/{session_id}",
    response_model=SessionInfo,
    summary="A session, with usage and limits",
    responses=_errors(),
)
async def get_session_info(session: Session = Depends(get_session)) -> SessionInfo:
    return session_info(session)


@router.delete(
    "/{session_id}",
    response_model=Deleted,
    summary="Delete a session",
    description="Cancels its running generations and releases all its blocks.",
    responses=_errors(),
)
async def delete_session(
    request: Request, session: Session = Depends(get_session), state: ServerState = Depends(get_state)
) -> Deleted:
    state.sessions.delete(session.id, principal(request))
    log.info("session deleted")
    return Deleted(id=session.id, object="session")


# ---------------------------------------------------------------------------------------- blocks


@router.post(
    "/{session_id}/blocks",
    status_code=201,
    response_model=BlockInfo,
    summary="Create a block",
    description="A new empty block, or one holding `text` / `token_ids` (written before the reply).",
    responses=_errors(409, 413, 429, 503),
)
async def create_block(
    request: Request,
    body: BlockCreate | None = Body(None),
    session: Session = Depends(get_session),
    state: ServerState = Depends(get_state),
) -> BlockInfo:
    body = body or BlockCreate()
    state.check_open()
    ids = None
    if body.text or body.token_ids:
        ids = await input_ids(state, body.text, body.token_ids)
    entry = state.call(session.new_block, body.name)
    if ids:
        try:
            async with abort_on_disconnect(request):
                await do_extend(state, session, entry, ids, priority=body.priority)
        except BaseException:
            try:
                session.delete_block(entry.id)
            except APIError:
                pass
            raise
    return block_info(state, session, entry)


@router.get(
    "/{session_id}/blocks",
    response_model=BlockList,
    summary="List blocks, with lengths and text",
    responses=_errors(),
)
async def list_blocks(
    session: Session = Depends(get_session),
    state: ServerState = Depends(get_state),
    text: bool = Query(True, description="Include each block's decoded text"),
    token_ids: bool = Query(False, description="Include each block's token ids"),
) -> BlockList:
    return BlockList(
        data=[
            block_info(state, session, e, text, token_ids)
            for e in session.blocks.values()
            if not e.block.freed
        ]
    )


@router.get(
    "/{session_id}/blocks/{block_id}", response_model=BlockInfo, summary="One block", responses=_errors()
)
async def get_block(
    block_id: str = BlockIdPath,
    session: Session = Depends(get_session),
    state: ServerState = Depends(get_state),
    text: bool = Query(True),
    token_ids: bool = Query(False),
) -> BlockInfo:
    return block_info(state, session, session.block(block_id), text, token_ids)


@router.delete(
    "/{session_id}/blocks/{block_id}",
    response_model=Deleted,
    summary="Delete (release) a block",
    description="Cancels a generation writing into it; memory returns once no running work reads it.",
    responses=_errors(),
)
async def delete_block(
    block_id: str = BlockIdPath,
    session: Session = Depends(get_session),
    state: ServerState = Depends(get_state),
) -> Deleted:
    state.call(session.delete_block, block_id)
    return Deleted(id=block_id, object="block")


@router.post(
    "/{session_id}/blocks/{block_id}/extend",
    response_model=BlockInfo,
    summary="Append text or tokens",
    description="Writes the input into the block, attending to `view` (default: the block alone); "
    "replies once it is in memory. 409 while a coroutine is writing the block.",
    responses=_errors(409, 413, 429, 503),
)
async def extend_block(
    request: Request,
    body: ExtendRequest,
    block_id: str = BlockIdPath,
    session: Session = Depends(get_session),
    state: ServerState = Depends(get_state),
) -> BlockInfo:
    entry = session.block(block_id)
    async with abort_on_disconnect(request):
        ids = await input_ids(state, body.text, body.token_ids)
        await do_extend(state, session, entry, ids, body.view, body.priority, body.name)
    return block_info(state, session, entry)


@router.post(
    "/{session_id}/blocks/{block_id}/truncate",
    response_model=BlockInfo,
    summary="Rewind a block to its first `length` tokens",
    responses=_errors(409, 413),
)
async def truncate_block(
    body: TruncateRequest,
    block_id: str = BlockIdPath,
    session: Session = Depends(get_session),
    state: ServerState = Depends(get_state),
) -> BlockInfo:
    entry = session.block(block_id)
    if body.length > entry.block.length:
        raise APIError(
            400,
            f"the block holds {entry.block.length} tokens; cannot truncate to {body.length}",
            "invalid_request_error",
            "invalid_value",
            "length",
        )
    state.call(state.engine.truncate, entry.block, body.length)
    return block_info(state, session, entry)


@router.post(
    "/{session_id}/blocks/{block_id}/fork",
    status_code=201,
    response_model=BlockInfo,
    summary="Fork a block (copy-on-write)",
    responses=_errors(409, 413, 429),
)
async def fork_block(
    body: ForkRequest | None = Body(None),
    block_id: str = BlockIdPath,
    session: Session = Depends(get_session),
    state: ServerState = Depends(get_state),
) -> BlockInfo:
    source = session.block(block_id)
    entry = state.call(session.new_block, body.name if body else None, source)
    return block_info(state, session, entry)


# ---------------------------------------------------------------------------------------- coroutines


@router.post(
    "/{session_id}/generate",
    response_model=GenerateResult,
    summary="Generate over a view",
    description="Generates into the view's last block. `stream` (default): SSE events `start`, "
    "`token`..., `end` (or `error`); leaving the stream cancels the generation. "
    "`background`: 202 with the coroutine, follow it with GET .../coroutines/{id}.",
    responses={
        **_errors(409, 413, 429, 503),
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

        async def stream() -> AsyncIterator[str]:
            state.streams_gauge.inc()
            try:
                async for event in running.events():
                    yield _sse(event)
            finally:
                state.streams_gauge.dec()

        return EventStream(stream(), on_disconnect=running.gen.cancel)
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
    responses=_errors(413, 429, 503),
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
    responses=_errors(),
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
    responses=_errors(),
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
    responses=_errors(409),
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


# ---------------------------------------------------------------------------------------- snapshots

SnapshotIdPath = Path(..., min_length=1, max_length=64, description="Snapshot id")


def _clean_snapshot_error(exc: SnapshotError, folder: pathlib.Path, snapshot_id: str) -> APIError:
    """The APIError for a snapshot the engine refused, naming the snapshot id, never a server path."""
    err = from_exception(exc)
    for place in (str(folder / BLOCKS_FILE), str(folder)):
        err.message = err.message.replace(place, snapshot_id)
    err.param = "snapshot"
    return err


@router.post(
    "/{session_id}/snapshot",
    status_code=201,
    response_model=SnapshotInfo,
    summary="Save the session's blocks to disk",
    description="Writes the blocks (all, or `blocks` in order) with their tokens, KV, Gated DeltaNet "
    "state, ids and labels to a snapshot on the server (never a path you choose) and returns its id; "
    "POST /v1/sessions/restore brings them back into a new session, also after a restart. A block "
    "being written is saved as far as it is written.",
    responses=_errors(429, 503),
)
async def snapshot_session(
    request: Request,
    body: SnapshotCreate | None = Body(None),
    session: Session = Depends(get_session),
    state: ServerState = Depends(get_state),
) -> SnapshotInfo:
    state.check_open()
    if body is not None and body.blocks is not None:
        entries = session.view(body.blocks)  # checks ids, duplicates and the view size limit
    else:
        entries = [e for e in session.blocks.values() if not e.block.freed]
    if not entries:
        raise APIError(400, "the session has no blocks to save", "invalid_request_error", "empty_input")
    snapshot_id, folder = state.snapshots.create(principal(request))
    try:
        async with abort_on_disconnect(request):
            await state.wait(state.engine.save(folder / BLOCKS_FILE, [e.block for e in entries]))
        manifest = SnapshotManifest(
            snapshot_id,
            session.id,
            session.name,
            int(time.time()),
            state.settings.model_name,
            [SnapshotBlock(e.id, e.name, e.block.length) for e in entries],
        )
        await asyncio.to_thread(state.snapshots.write_manifest, folder, manifest)
    except OSError:
        state.snapshots.discard(folder)
        log.exception("writing snapshot %s failed", snapshot_id)
        raise APIError(
            500, "the snapshot could not be written", "server_error", "snapshot_write_failed"
        ) from None
    except BaseException:
        state.snapshots.discard(folder)
        raise
    log.info("session saved to snapshot %s (%d blocks)", snapshot_id, len(entries))
    return snapshot_info(state, folder, manifest)


def snapshot_info(state: ServerState, folder: pathlib.Path, manifest: SnapshotManifest) -> SnapshotInfo:
    return SnapshotInfo(
        id=manifest.id,
        session=manifest.source_session,
        created=manifest.created,
        model=manifest.model,
        blocks=[SnapshotBlockInfo(id=b.id, name=b.name, length=b.length) for b in manifest.blocks],
        tokens=manifest.tokens,
        bytes=state.snapshots.file_bytes(folder),
    )


@router.post(
    "/restore",
    status_code=201,
    response_model=RestoredSession,
    summary="A new session from a snapshot",
    description="Loads a snapshot this API key saved into a new session: its blocks keep their ids, "
    "labels, tokens and memory (next-token logits equal the saved session's). 404: no such snapshot "
    "for this key; 409 `snapshot_mismatch`: saved from another model or dtype; 400 `snapshot_invalid`: "
    "the snapshot is damaged. Counts against the session, block and memory quotas like new blocks.",
    responses=_errors(409, 429, 503),
)
async def restore_session(
    request: Request, body: RestoreRequest, state: ServerState = Depends(get_state)
) -> RestoredSession:
    state.check_open()
    owner = principal(request)
    folder = state.snapshots.folder(owner, body.snapshot)
    try:
        manifest = state.snapshots.read_manifest(folder)
    except SnapshotError as exc:
        raise _clean_snapshot_error(exc, folder, body.snapshot) from None
    if len(manifest.blocks) > state.settings.session_max_blocks:
        raise APIError(
            429,
            f"the snapshot holds {len(manifest.blocks)} blocks; a session may hold "
            f"{state.settings.session_max_blocks}",
            "quota_error",
            "session_block_quota",
        )
    session = state.sessions.create(owner, body.name if body.name is not None else manifest.session_name)
    session_var.set(session.id)
    try:
        try:
            blocks = state.call(state.engine.load, folder / BLOCKS_FILE)
        except APIError as exc:
            if isinstance(exc.__cause__, SnapshotError):
                raise _clean_snapshot_error(exc.__cause__, folder, body.snapshot) from None
            raise
        except Exception:  # the file reader's own errors (a damaged tensor section): nothing was loaded
            log.warning("snapshot %s could not be read", body.snapshot, exc_info=True)
            raise APIError(
                400, "the snapshot is damaged", "invalid_request_error", "snapshot_invalid", "snapshot"
            ) from None
        if [b.name for b in blocks] != [b.id for b in manifest.blocks]:
            for block in blocks:
                state.engine.release(block)
            raise APIError(
                400,
                "the snapshot's blocks do not match its session record",
                "invalid_request_error",
                "snapshot_invalid",
                "snapshot",
            )
        for i, (block, saved) in enumerate(zip(blocks, manifest.blocks)):
            try:
                session.adopt_block(saved.id, block, saved.name)
            except BaseException:
                for rest in blocks[i + 1 :]:
                    state.engine.release(rest)
                raise
    except BaseException:
        state.sessions.delete(session.id, owner)  # releases the blocks it took in
        raise
    log.info("session restored from snapshot %s (%d blocks)", manifest.id, len(blocks))
    info = session_info(session)
    return RestoredSession(
        **info.model_dump(),
        snapshot=manifest.id,
        blocks=[block_info(state, session, session.blocks[b.id]) for b in manifest.blocks],
    )


@router.delete(
    "/snapshots/{snapshot_id}",
    response_model=Deleted,
    summary="Delete a snapshot",
    description="Removes a snapshot this API key saved (each key may keep `key_max_snapshots`).",
    responses=_errors(),
)
async def delete_snapshot(
    request: Request, snapshot_id: str = SnapshotIdPath, state: ServerState = Depends(get_state)
) -> Deleted:
    await asyncio.to_thread(state.snapshots.delete, principal(request), snapshot_id)
    return Deleted(id=snapshot_id, object="session.snapshot")


# ---------------------------------------------------------------------------------------- websocket

_WS_MESSAGE = TypeAdapter(WsMessage)
_WS_TYPES = ("generate", "extend", "probe", "cancel")


def ws_validation_error(exc: ValidationError) -> APIError:
    """validation_error for a WebSocket message: the message type tag is not part of the field."""
    errors = []
    for e in exc.errors():
        loc = tuple(e.get("loc", ()))
        errors.append({**e, "loc": loc[1:] if loc and loc[0] in _WS_TYPES else loc})
    err = validation_error(errors)
    err.code = "invalid_message" if err.code == "invalid_request" else err.code
    return err



@router.websocket("/{session_id}/ws")
async def session_socket(websocket: WebSocket, session_id: str) -> None:
    """Full duplex: send generate / extend / probe / cancel messages; events stream back as JSON."""
    state = get_ws_state(websocket)
    try:
        session = state.sessions.get(session_id, principal(websocket))
    except APIError:
        await websocket.close(code=1008, reason="no such session")
        return
    await websocket.accept()
    session_var.set(session.id)
    state.streams_gauge.inc()
    session.sockets += 1
    socket = _SessionSocket(websocket, state, session)
    try:
        await socket.serve()
    except WebSocketDisconnect:
        pass
    except RuntimeError:  # the socket closed under us (server shutdown)
        pass
    finally:
        session.sockets -= 1
        await socket.close()
        state.streams_gauge.dec()


class _SessionSocket:
    """One WebSocket on a session: reads messages, runs each request as its own task, sends events
    (one sender at a time) and cancels what it started when the socket goes."""

    def __init__(self, websocket: WebSocket, state: ServerState, session: Session):
        self.websocket, self.state, self.session = websocket, state, session
        self.lock = asyncio.Lock()
        self.tasks: set[asyncio.Task] = set()
        self.mine: dict[str, Running] = {}

    async def serve(self) -> None:
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            msg = await self.parse(message.get("text"))
            if msg is None:
                continue
            if isinstance(msg, WsGenerate):
                self.spawn(self.run_generate(msg))
            elif isinstance(msg, WsExtend):
                self.spawn(self.run_extend(msg))
            elif isinstance(msg, WsProbe):
                self.spawn(self.run_probe(msg))
            else:
                await self.cancel(msg)

    async def parse(self, raw: str | None) -> Any:
        """The message, or None after sending the client an error for it."""
        if raw is None:
            err = APIError(400, "binary frames are not supported: send JSON as text", code="invalid_message")
            await self.send({"type": "error", **err.body()}, None)
            return None
        # the same size limit as HTTP bodies, checked before parsing or tokenizing anything
        limit = self.state.settings.max_body_bytes
        if len(raw) > limit and len(raw.encode("utf-8", "surrogatepass")) > limit:
            err = APIError(413, f"message exceeds {limit} bytes", code="body_too_large")
            await self.send({"type": "error", **err.body()}, None)
            return None
        try:  # json.loads, as for HTTP bodies: a lone surrogate escape is then a 400 naming its field
            return _WS_MESSAGE.validate_python(json.loads(raw))
        except json.JSONDecodeError:
            err = APIError(400, "the message is not valid JSON", code="invalid_json")
            await self.send({"type": "error", **err.body()}, None)
        except ValidationError as exc:
            await self.send({"type": "error", **ws_validation_error(exc).body()}, None)
        return None

    async def send(self, event: dict, ref: str | None) -> None:
        if ref is not None:
            event = {**event, "id": ref}
        async with self.lock:
            await self.websocket.send_text(json.dumps(event, ensure_ascii=False, separators=(",", ":")))

    async def send_error(self, exc: BaseException, ref: str | None) -> None:
        err = from_exception(exc)
        await self.send({"type": "error", "coroutine": None, **err.body()}, ref)

    def spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run_generate(self, msg: WsGenerate) -> None:
        try:
            running = start_generation(self.state, self.session, msg)
        except Exception as exc:
            await self.send_error(exc, msg.id)
            return
        self.mine[running.co.id] = running
        try:
            async for event in running.events():
                await self.send(event, msg.id)
        finally:
            self.mine.pop(running.co.id, None)

    async def run_extend(self, msg: WsExtend) -> None:
        try:
            entry = self.session.block(msg.block)
            ids = await input_ids(self.state, msg.text, msg.token_ids)
            await do_extend(self.state, self.session, entry, ids, msg.view, msg.priority, msg.name)
            await self.send({"type": "extended", "block": entry.id, "length": entry.block.length}, msg.id)
        except Exception as exc:
            await self.send_error(exc, msg.id)

    async def run_probe(self, msg: WsProbe) -> None:
        try:
            result = await do_probe(self.state, self.session, msg)
            await self.send({"type": "probe", **result.model_dump()}, msg.id)
        except Exception as exc:
            await self.send_error(exc, msg.id)

    async def cancel(self, msg: WsCancel) -> None:
        if msg.coroutine is not None:
            try:
                targets = [self.session.coroutine(msg.coroutine)]
            except APIError as exc:
                await self.send_error(exc, msg.id)
                return
        else:
            targets = [r.co for r in self.mine.values()]
        cancelled = [co.id for co in targets if co.cancel()]
        await self.send({"type": "cancelled", "coroutines": cancelled}, msg.id)

    async def close(self) -> None:
        for running in list(self.mine.values()):
            running.co.cancel()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
