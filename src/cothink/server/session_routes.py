"""Session routes: create, list, read and delete the caller's sessions."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Body, Depends, Request

from cothink.observability.logs import session_var
from cothink.server.errors import APIError
from cothink.server.schemas import Deleted, SessionCreate, SessionInfo
from cothink.server.session_http import errors_doc, get_session, session_info
from cothink.server.sessions import Session
from cothink.server.state import ServerState, get_state, principal

log = logging.getLogger("cothink.server")
router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


@router.post(
    "",
    status_code=201,
    response_model=SessionInfo,
    summary="Create a session",
    responses=errors_doc(413, 429),
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
    responses=errors_doc(403),
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
    responses=errors_doc(),
)
async def get_session_info(session: Session = Depends(get_session)) -> SessionInfo:
    return session_info(session)


@router.delete(
    "/{session_id}",
    response_model=Deleted,
    summary="Delete a session",
    description="Cancels its running generations and releases all its blocks.",
    responses=errors_doc(),
)
async def delete_session(
    request: Request, session: Session = Depends(get_session), state: ServerState = Depends(get_state)
) -> Deleted:
    state.sessions.delete(session.id, principal(request))
    log.info("session deleted")
    return Deleted(id=session.id, object="session")
