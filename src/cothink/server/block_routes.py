"""Block routes: create, list, read, extend, truncate, fork and delete a session's blocks."""

from __future__ import annotations

from fastapi import APIRouter, Body, Depends, Query, Request

from cothink.server.coroutines import do_extend, extend_from, input_ids
from cothink.server.errors import APIError
from cothink.server.schemas import (
    BlockCreate,
    BlockInfo,
    BlockList,
    Deleted,
    ExtendRequest,
    ForkRequest,
    TruncateRequest,
)
from cothink.server.session_http import BlockIdPath, block_info, errors_doc, get_session
from cothink.server.sessions import Session
from cothink.server.state import ServerState, get_state
from cothink.server.streaming import abort_on_disconnect

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


@router.post(
    "/{session_id}/blocks",
    status_code=201,
    response_model=BlockInfo,
    summary="Create a block",
    description="A new empty block, or one holding `text` / `token_ids` (written before the reply).",
    responses=errors_doc(409, 413, 429, 503),
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
    responses=errors_doc(),
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
    "/{session_id}/blocks/{block_id}", response_model=BlockInfo, summary="One block", responses=errors_doc()
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
    responses=errors_doc(),
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
    summary="Append text, tokens, an image or a frame group",
    description="Writes the input into the block, attending to `view` (default: the block alone); "
    "replies once it is in memory. 409 while a coroutine is writing the block.",
    responses=errors_doc(409, 413, 429, 503),
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
        await extend_from(state, session, entry, body)
    return block_info(state, session, entry)


@router.post(
    "/{session_id}/blocks/{block_id}/truncate",
    response_model=BlockInfo,
    summary="Rewind a block to its first `length` tokens",
    responses=errors_doc(409, 413),
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
    responses=errors_doc(409, 413, 429),
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
