"""Snapshot routes: save a session's blocks to disk, restore them into a new session, list and delete
a key's snapshots. Files are read, checked and written in worker threads; only copying the blocks'
memory (between engine steps) and creating the blocks run on the event loop."""

from __future__ import annotations

import asyncio
import logging
import pathlib
import time

from fastapi import APIRouter, Body, Depends, Path, Request

from cothink.errors import SnapshotError
from cothink.memory.snapshot import LoadedSnapshot, read_header, read_snapshot, restore_plan, share_plan
from cothink.observability.logs import session_var
from cothink.server.errors import APIError, from_exception
from cothink.server.schemas import (
    Deleted,
    RestoredSession,
    RestoreRequest,
    SnapshotBlockInfo,
    SnapshotCreate,
    SnapshotInfo,
    SnapshotListed,
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
    owner = principal(request)
    await asyncio.to_thread(state.snapshots.expire, owner)
    # at least its distinct KV pages: refused before writing when even those cannot fit the key's bytes
    pages = {p for e in entries for p in e.block.pages}
    snapshot_id, folder = state.snapshots.create(owner, len(pages) * state.ledger.geometry.bytes_per_page)
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
        await asyncio.to_thread(state.snapshots.commit, owner, folder, manifest)
        size = await asyncio.to_thread(state.snapshots.file_bytes, folder)
    except OSError:
        state.snapshots.discard(folder)
        log.exception("writing snapshot %s failed", snapshot_id)
        raise APIError(
            500, "the snapshot could not be written", "server_error", "snapshot_write_failed"
        ) from None
    except BaseException:
        state.snapshots.discard(folder)
        raise
    log.info("session saved to snapshot %s (%d blocks, %d bytes)", snapshot_id, len(entries), size)
    return snapshot_info(manifest, size)


def snapshot_info(manifest: SnapshotManifest, size: int) -> SnapshotInfo:
    return SnapshotInfo(
        id=manifest.id,
        session=manifest.source_session,
        created=manifest.created,
        model=manifest.model,
        blocks=[SnapshotBlockInfo(id=b.id, name=b.name, length=b.length) for b in manifest.blocks],
        tokens=manifest.tokens,
        bytes=size,
    )


@router.get(
    "/snapshots",
    response_model=list[SnapshotListed],
    summary="List this key's snapshots",
    description="Every snapshot this API key keeps, newest first, with its size on disk: `complete` ones "
    "(restorable), one `writing` now, and `unfinished` ones a crash cut short (they count against the "
    "key's snapshot quotas: delete them). Snapshots older than the server's snapshot_ttl_s are deleted "
    "first. Needs an API key, as listing sessions does (403 unless the server allows it).",
    responses=errors_doc(403),
)
async def list_snapshots(request: Request, state: ServerState = Depends(get_state)) -> list[SnapshotListed]:
    if not state.settings.keys() and not state.settings.list_sessions_without_key:
        raise APIError(
            403,
            "listing snapshots needs an API key: without keys a snapshot is reachable only through the "
            "id returned when it was saved",
            "permission_error",
            "listing_disabled",
        )
    owner = principal(request)

    def listing() -> list[SnapshotListed]:
        state.snapshots.expire(owner)
        out = []
        for snap in state.snapshots.entries(owner):
            m = snap.manifest
            out.append(
                SnapshotListed(
                    id=snap.id,
                    status=snap.status,
                    created=snap.created,
                    bytes=snap.bytes,
                    session=m.source_session if m else None,
                    model=m.model if m else None,
                    blocks=[SnapshotBlockInfo(id=b.id, name=b.name, length=b.length) for b in m.blocks]
                    if m
                    else None,
                    tokens=m.tokens if m else None,
                )
            )
        return out

    return await asyncio.to_thread(listing)


async def read_for_restore(
    state: ServerState, owner: str, snapshot_id: str
) -> tuple[pathlib.Path, SnapshotManifest, LoadedSnapshot]:
    """The snapshot's session record and its data, read and checked in worker threads; what it holds is
    checked against the key's quotas from its header alone, before its data is read."""
    await asyncio.to_thread(state.snapshots.expire, owner)
    folder = state.snapshots.folder(owner, snapshot_id)
    try:
        manifest = await asyncio.to_thread(state.snapshots.read_manifest, folder)
        header = await asyncio.to_thread(read_header, folder / BLOCKS_FILE)
    except SnapshotError as exc:
        raise _clean_snapshot_error(exc, folder, snapshot_id) from None
    settings, ledger = state.settings, state.ledger
    if len(manifest.blocks) > settings.session_max_blocks:
        raise APIError(
            429,
            f"the snapshot holds {len(manifest.blocks)} blocks; a session may hold "
            f"{settings.session_max_blocks}",
            "quota_error",
            "session_block_quota",
        )
    tokens = sum(b.length for b in header.blocks)
    if settings.session_max_tokens is not None and tokens > settings.session_max_tokens:
        raise APIError(
            429,
            f"the snapshot holds {tokens} tokens; a session may hold {settings.session_max_tokens}",
            "quota_error",
            "session_token_quota",
        )
    g = ledger.geometry
    plan = share_plan(header, g.page_size)  # forks share their pages again (the engine's restore_plan)
    pages = sum(g.pages_for(b.length) - s.tokens // g.page_size for b, s in zip(header.blocks, plan))
    # without keys every session is its own account: only the pool bounds a new one
    account = owner if settings.keys() else None
    if account is not None:
        ledger.check_fits(account, None, pages, 0, f"snapshot {snapshot_id!r}")
    else:
        ledger.check_request(pages, f"snapshot {snapshot_id!r}")
    try:
        loaded = await asyncio.to_thread(read_snapshot, folder / BLOCKS_FILE)
    except SnapshotError as exc:
        raise _clean_snapshot_error(exc, folder, snapshot_id) from None
    return folder, manifest, loaded


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
    folder, manifest, loaded = await read_for_restore(state, owner, body.snapshot)
    state.check_open()
    session = state.sessions.create(owner, body.name if body.name is not None else manifest.session_name)
    session_var.set(session.id)
    try:
        try:
            blocks = state.call(state.engine.load, loaded)
        except APIError as exc:
            if isinstance(exc.__cause__, SnapshotError):
                raise _clean_snapshot_error(exc.__cause__, folder, body.snapshot) from None
            raise
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
        plan = restore_plan(loaded, state.ledger.geometry.page_size)
        for i, (block, saved) in enumerate(zip(blocks, manifest.blocks)):
            shared = plan[i]
            shares = (blocks[shared.source], shared.tokens // state.ledger.geometry.page_size)
            try:
                session.adopt_block(saved.id, block, saved.name, shares if shared.source >= 0 else None)
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
    description="Removes a snapshot this API key saved, complete or unfinished (each key may keep "
    "`key_max_snapshots` snapshots and `key_max_snapshot_bytes` bytes). 409 `snapshot_busy` while it "
    "is being written.",
    responses=errors_doc(409),
)
async def delete_snapshot(
    request: Request, snapshot_id: str = SnapshotIdPath, state: ServerState = Depends(get_state)
) -> Deleted:
    await asyncio.to_thread(state.snapshots.delete, principal(request), snapshot_id)
    return Deleted(id=snapshot_id, object="session.snapshot")
