"""What every session route shares: path parameters, the session dependency, the documented error
answers and the JSON records of sessions, blocks and coroutines."""

from __future__ import annotations

from fastapi import Path, Request

from cothink.observability.logs import session_var
from cothink.server.errors import ERROR_RESPONSES
from cothink.server.schemas import BlockInfo, CoroutineInfo, SessionInfo
from cothink.server.sessions import BlockEntry, CoroutineEntry, Session
from cothink.server.state import ServerState, principal

SessionId = Path(..., min_length=1, max_length=64, description="Session id")
BlockIdPath = Path(..., min_length=1, max_length=64, description="Block id (of this session)")
CoroutineIdPath = Path(..., min_length=1, max_length=64, description="Coroutine id (of this session)")


def errors_doc(*codes: int) -> dict:
    """The error answers a session route documents: 400, 401 and 404, plus `codes`."""
    return {c: ERROR_RESPONSES[c] for c in (400, 401, 404, *codes)}


async def get_session(request: Request, session_id: str = SessionId) -> Session:
    """FastAPI dependency: the caller's session named in the path (404 for anyone else's)."""
    session = request.app.state.cothink.sessions.get(session_id, principal(request))
    session_var.set(session.id)
    return session


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
