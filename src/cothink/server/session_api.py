"""The session API: blocks, views, generations, probes and coroutines, over HTTP, SSE and WebSocket."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Body, Depends, Path, Query, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse
from opentelemetry import trace
from pydantic import TypeAdapter, ValidationError

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
    SessionCreate,
    SessionInfo,
    TruncateRequest,
    WsCancel,
    WsExtend,
    WsGenerate,
    WsMessage,
    WsProbe,
)
from cothink.server.sessions import BlockEntry, CoroutineEntry, Session
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
    lock = asyncio.Lock()
    tasks: set[asyncio.Task] = set()
    mine: dict[str, Running] = {}

    async def send(event: dict, ref: str | None) -> None:
        if ref is not None:
            event = {**event, "id": ref}
        async with lock:
            await websocket.send_text(json.dumps(event, ensure_ascii=False, separators=(",", ":")))

    async def send_error(exc: BaseException, ref: str | None, coroutine: str | None = None) -> None:
        err = from_exception(exc)
        await send({"type": "error", "coroutine": coroutine, **err.body()}, ref)

    async def run_generate(msg: WsGenerate) -> None:
        try:
            running = start_generation(state, session, msg)
        except Exception as exc:
            await send_error(exc, msg.id)
            return
        mine[running.co.id] = running
        try:
            async for event in running.events():
                await send(event, msg.id)
        finally:
            mine.pop(running.co.id, None)

    async def run_extend(msg: WsExtend) -> None:
        try:
            entry = session.block(msg.block)
            ids = await input_ids(state, msg.text, msg.token_ids)
            await do_extend(state, session, entry, ids, msg.view, msg.priority, msg.name)
            await send({"type": "extended", "block": entry.id, "length": entry.block.length}, msg.id)
        except Exception as exc:
            await send_error(exc, msg.id)

    async def run_probe(msg: WsProbe) -> None:
        try:
            result = await do_probe(state, session, msg)
            await send({"type": "probe", **result.model_dump()}, msg.id)
        except Exception as exc:
            await send_error(exc, msg.id)

    async def cancel(msg: WsCancel) -> None:
        if msg.coroutine is not None:
            try:
                targets = [session.coroutine(msg.coroutine)]
            except APIError as exc:
                await send_error(exc, msg.id)
                return
        else:
            targets = [r.co for r in mine.values()]
        cancelled = [co.id for co in targets if co.cancel()]
        await send({"type": "cancelled", "coroutines": cancelled}, msg.id)

    def spawn(coro) -> None:
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    limit = state.settings.max_body_bytes
    session.sockets += 1
    try:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                break
            raw = message.get("text")
            if raw is None:
                err = APIError(
                    400, "binary frames are not supported: send JSON as text", code="invalid_message"
                )
                await send({"type": "error", **err.body()}, None)
                continue
            # the same size limit as HTTP bodies, checked before parsing or tokenizing anything
            if len(raw) > limit and len(raw.encode("utf-8", "surrogatepass")) > limit:
                err = APIError(413, f"message exceeds {limit} bytes", code="body_too_large")
                await send({"type": "error", **err.body()}, None)
                continue
            try:  # json.loads, as for HTTP bodies: a lone surrogate escape is then a 400 naming its field
                msg = _WS_MESSAGE.validate_python(json.loads(raw))
            except json.JSONDecodeError:
                err = APIError(400, "the message is not valid JSON", code="invalid_json")
                await send({"type": "error", **err.body()}, None)
                continue
            except ValidationError as exc:
                await send({"type": "error", **ws_validation_error(exc).body()}, None)
                continue
            if isinstance(msg, WsGenerate):
                spawn(run_generate(msg))
            elif isinstance(msg, WsExtend):
                spawn(run_extend(msg))
            elif isinstance(msg, WsProbe):
                spawn(run_probe(msg))
            else:
                await cancel(msg)
    except WebSocketDisconnect:
        pass
    except RuntimeError:  # the socket closed under us (server shutdown)
        pass
    finally:
        session.sockets -= 1
        for running in list(mine.values()):
            running.co.cancel()
        for task in list(tasks):
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        state.streams_gauge.dec()
