"""Snapshot routes: save a session's blocks to disk, restore them into a new session, delete a
snapshot."""

from __future__ import annotations

import asyncio
import logging
import pathlib
import time

from fastapi import APIRouter, Body, Depends, Path, Request

from cothink.errors import SnapshotError
from cothink.observability.logs import session_var
from cothink.server.errors import APIError, from_exception
from cothink.server.schemas import (
    Deleted,
    RestoredSession,
    RestoreRequest,
    SnapshotBlockInfo,
    SnapshotCreate,
    SnapshotInfo,
)
from cothink.server.session_http import block_info, errors_doc, get_session, session_info
from cothink.server.sessions import Session
from cothink.server.snapshots import BLOCKS_FILE, SnapshotBlock, SnapshotManifest
from cothink.server.state import ServerState, get_state, principal
from cothink.server.streaming import abort_on_disconnect

log = logging.getLogger("cothink.server")
router = APIRouter(prefix="/v1/sessions", tags=["sessions"])

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
    responses=errors_doc(429, 503),
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
    responses=errors_doc(409, 429, 503),
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
    responses=errors_doc(),
)
async def delete_snapshot(
    request: Request, snapshot_id: str = SnapshotIdPath, state: ServerState = Depends(get_state)
) -> Deleted:
    await asyncio.to_thread(state.snapshots.delete, principal(request), snapshot_id)
    return Deleted(id=snapshot_id, object="session.snapshot")
