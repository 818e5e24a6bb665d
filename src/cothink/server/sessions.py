"""Sessions: a key's private namespace of blocks and coroutines, with quotas.

Ids are unguessable (secrets.token_urlsafe) and resolved only inside their session, and a session only
for the key that created it: anything else is 404, so ids never leak whether they exist elsewhere.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cothink.memory.block import Block
from cothink.observability.logs import bind_owner, forget_owner
from cothink.server.errors import APIError, not_found
from cothink.server.journal import Journal
from cothink.server.quota import MemoryLedger, Reservation
from cothink.server.settings import ServerSettings

if TYPE_CHECKING:
    from cothink.runtime.engine import Engine, Generation


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(16)}"


@dataclass(eq=False)
class BlockEntry:
    id: str
    block: Block
    name: str | None
    created: int
    last_used: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class CoroutineEntry:
    id: str
    kind: str  # extend | generate | probe
    name: str | None
    view: list[str]
    block: str | None
    created: int
    max_tokens: int = 0  # extends and generations: tokens reserved against the session quota
    status: str = "running"  # running | finished | failed
    finish_reason: str | None = None
    error: str | None = None
    generation: Generation | None = None
    task: asyncio.Task | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    reservation: Reservation | None = None  # the memory it may still add, against the quotas

    @property
    def running(self) -> bool:
        return self.status == "running"

    def cancel(self) -> bool:
        """Stop a running generation (finish reason 'cancelled'); False when there is nothing to stop."""
        if self.generation is not None and self.running:
            self.generation.cancel()
            return True
        return False


class Session:
    def __init__(self, manager: SessionManager, owner: str, name: str | None, session_id: str | None = None):
        self.manager = manager
        self.id = session_id or new_id("sess")  # given: a session restored from its journal
        self.owner = owner
        # the memory account: the key; without keys every session is its own account
        self.account = owner if manager.settings.keys() else self.id
        self.name = name
        self.created = int(time.time())
        self.last_used = time.monotonic()
        self.sockets = 0  # open WebSockets keep a session alive
        self.blocks: dict[str, BlockEntry] = {}
        self.coroutines: OrderedDict[str, CoroutineEntry] = OrderedDict()
        self.closed = False

    @property
    def engine(self) -> Engine:
        return self.manager.engine

    @property
    def settings(self) -> ServerSettings:
        return self.manager.settings

    # ---- accounting ---------------------------------------------------------------------------
    def running(self) -> list[CoroutineEntry]:
        return [c for c in self.coroutines.values() if c.running]

    @property
    def ledger(self) -> MemoryLedger:
        return self.manager.ledger

    def tokens_used(self) -> int:
        return self.ledger.usage(session=self.id).tokens

    def usage(self) -> dict[str, int]:
        memory = self.ledger.usage(session=self.id)
        return {
            "blocks": len(self.blocks),
            "tokens": memory.tokens,
            "pages": memory.pages,
            "running": len(self.running()),
        }

    def limits(self) -> dict[str, int | None]:
        s = self.settings
        return {
            "max_blocks": s.session_max_blocks,
            "max_tokens": s.session_max_tokens,
            "max_running": s.session_max_running,
            "key_max_pages": self.ledger.account_max_pages,
        }

    def reserve(self, entry: BlockEntry, tokens: int) -> Reservation:
        """Reserve what a work will add to `entry` against the session's and the key's quotas (atomic:
        no await between the check and the reservation)."""
        self._check_open()
        return self.ledger.reserve(entry.block, tokens)

    def check_running(self) -> None:
        if len(self.running()) >= self.settings.session_max_running:
            raise APIError(
                429,
                f"session already runs {self.settings.session_max_running} coroutines",
                "quota_error",
                "session_coroutine_quota",
            )

    # ---- blocks -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise not_found("session", self.id, "session_not_found")

    def check_block_quota(self, more: int = 1) -> None:
        if len(self.blocks) + more > self.settings.session_max_blocks:
            raise APIError(
                429,
                f"session block quota reached ({self.settings.session_max_blocks} blocks)",
                "quota_error",
                "session_block_quota",
            )

    def new_block(
        self, name: str | None, fork_of: BlockEntry | None = None, block_id: str | None = None
    ) -> BlockEntry:
        self._check_open()
        self.check_block_quota()
        block_id = block_id or new_id("blk")  # given: a block restored from its journal
        if fork_of is not None:
            block = self.engine.fork(fork_of.block, name=block_id)
        else:
            block = self.engine.block(name=block_id)
        return self._add(block_id, block, name, fork_of)

    def adopt_block(
        self, block_id: str, block: Block, name: str | None, shares: tuple[Block, int] | None = None
    ) -> BlockEntry:
        """Take in a block the engine already holds (one restored from a snapshot, keeping its id),
        charged to the quotas with its length, less the pages it `shares` (block, whole pages) with a
        block restored before it; on refusal the block is released."""
        self._check_open()
        if block_id in self.blocks:
            self.engine.release(block)
            raise APIError(409, f"block {block_id!r} already exists", "conflict_error", "block_exists")
        try:
            self.check_block_quota()
        except APIError:
            self.engine.release(block)
            raise
        return self._add(block_id, block, name, None, shares)

    def _add(
        self,
        block_id: str,
        block: Block,
        name: str | None,
        fork_of: BlockEntry | None,
        shares: tuple[Block, int] | None = None,
    ) -> BlockEntry:
        source, shared = shares if shares is not None else (fork_of.block if fork_of else None, None)
        try:
            self.ledger.add_block(block, self.account, self.id, source, shared_pages=shared)
        except BaseException:
            self.engine.release(block)
            raise
        entry = BlockEntry(block_id, block, name, int(time.time()))
        try:
            self.manager.journal.block_added(self, entry, fork_of)
        except BaseException:
            self.ledger.drop_block(block)
            self.engine.release(block)
            raise
        self.blocks[block_id] = entry
        bind_owner(block_id, self.id)
        return entry

    def block(self, block_id: str) -> BlockEntry:
        entry = self.blocks.get(block_id)
        if entry is None or entry.block.freed:
            raise not_found("block", block_id, "block_not_found")
        entry.last_used = time.monotonic()
        return entry

    def view(self, block_ids: list[str]) -> list[BlockEntry]:
        if len(block_ids) > self.settings.max_view_blocks:
            raise APIError(
                400,
                f"a view may hold at most {self.settings.max_view_blocks} blocks",
                "invalid_request_error",
                "invalid_view",
                "view",
            )
        if len(set(block_ids)) != len(block_ids):
            raise APIError(
                400, "a block appears twice in the view", "invalid_request_error", "invalid_view", "view"
            )
        return [self.block(b) for b in block_ids]

    def writer(self, entry: BlockEntry) -> CoroutineEntry | None:
        for c in self.coroutines.values():
            if c.running and c.block == entry.id:
                return c
        return None

    def delete_block(self, block_id: str, journal: bool = True) -> None:
        """Release a block (journaled first, unless `journal` is false: the whole session is going)."""
        entry = self.block(block_id)
        if journal:
            self.manager.journal.block_released(self, entry)
        del self.blocks[block_id]
        forget_owner(block_id)
        self.ledger.drop_block(entry.block)
        self.engine.release(entry.block)  # cancels its writer, if any

    # ---- coroutines ---------------------------------------------------------------------------
    def new_coroutine(
        self, kind: str, name: str | None, view: list[str], block: str | None, max_tokens: int = 0
    ) -> CoroutineEntry:
        self._check_open()
        self.check_running()
        entry = CoroutineEntry(new_id("co"), kind, name, list(view), block, int(time.time()), max_tokens)
        self.coroutines[entry.id] = entry
        bind_owner(entry.id, self.id)
        return entry

    def coroutine(self, coroutine_id: str) -> CoroutineEntry:
        entry = self.coroutines.get(coroutine_id)
        if entry is None:
            raise not_found("coroutine", coroutine_id, "coroutine_not_found")
        return entry

    def finish(
        self,
        entry: CoroutineEntry,
        status: str = "finished",
        finish_reason: str | None = None,
        error: str | None = None,
    ) -> None:
        if not entry.running:
            return
        entry.status, entry.finish_reason, entry.error = status, finish_reason, error
        if entry.block is not None:
            self.manager.journal.work_ended(self, entry)
        entry.generation = None
        if entry.reservation is not None:
            entry.reservation.release()
        now = time.monotonic()
        self.last_used = now
        for block_id in {*entry.view, entry.block}:
            if block_id in self.blocks:
                self.blocks[block_id].last_used = now
        finished = [k for k, c in self.coroutines.items() if not c.running]
        for key in finished[: max(len(finished) - self.settings.session_keep_finished, 0)]:
            forget_owner(key)
            del self.coroutines[key]

    def close(self) -> None:
        """Cancel running generations and release every block."""
        if self.closed:
            return
        for c in list(self.coroutines.values()):
            c.cancel()
            if c.task is not None and not c.task.done():
                c.task.cancel()
        for block_id in list(self.blocks):
            try:
                self.delete_block(block_id, journal=False)
            except Exception:  # already released
                pass
        self.closed = True
        for key in self.coroutines:
            forget_owner(key)

    def busy(self) -> set[str]:
        """Blocks that running coroutines read or write."""
        return {b for c in self.running() for b in (*c.view, c.block) if b}

    def expire_blocks(self, now: float, idle_s: float) -> int:
        busy = self.busy()
        stale = [b for b, e in self.blocks.items() if b not in busy and now - e.last_used > idle_s]
        for block_id in stale:
            self.delete_block(block_id)
        return len(stale)

    def idle(self, now: float, idle_s: float) -> bool:
        return not self.sockets and not self.running() and now - self.last_used > idle_s


class SessionManager:
    def __init__(
        self, engine: Engine, settings: ServerSettings, ledger: MemoryLedger, journal: Journal | None = None
    ):
        self.engine, self.settings, self.ledger = engine, settings, ledger
        self.journal = journal or Journal()  # every change to a session, on disk first (journal.py)
        self.sessions: dict[str, Session] = {}

    def create(self, owner: str, name: str | None = None) -> Session:
        if len(self.sessions) >= self.settings.max_sessions:
            raise APIError(
                429,
                f"the server holds its maximum of {self.settings.max_sessions} sessions",
                "quota_error",
                "session_limit",
            )
        per_key = self.settings.sessions_per_key()
        if self.settings.keys() and sum(s.owner == owner for s in self.sessions.values()) >= per_key:
            raise APIError(
                429,
                f"this API key holds its maximum of {per_key} sessions; delete some (idle ones expire)",
                "quota_error",
                "key_session_limit",
            )
        session = Session(self, owner, name)
        self.journal.session_created(session, self.settings.model_name)
        self.sessions[session.id] = session
        bind_owner(session.id, session.id)
        return session

    def get(self, session_id: str, owner: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.owner != owner or session.closed:
            raise APIError(404, f"no session {session_id!r}", "not_found_error", "session_not_found")
        session.last_used = time.monotonic()
        return session

    def expire(self, now: float) -> int:
        """Delete idle sessions and release idle blocks; returns how many went."""
        s, n = self.settings, 0
        for session in list(self.sessions.values()):
            if s.session_idle_s is not None and session.idle(now, s.session_idle_s):
                self.delete(session.id, session.owner)
                n += 1
            elif s.block_expiry_s() is not None:
                n += session.expire_blocks(now, s.block_expiry_s())
        return n

    def delete(self, session_id: str, owner: str) -> None:
        session = self.get(session_id, owner)
        self.journal.session_deleted(session)
        session.close()
        del self.sessions[session_id]
        forget_owner(session_id)

    def cancel_all(self) -> int:
        n = 0
        for session in self.sessions.values():
            for c in session.coroutines.values():
                n += c.cancel()
        return n

    def close_all(self) -> None:
        for session in list(self.sessions.values()):
            session.close()
        self.sessions.clear()

    def stats(self) -> dict[str, Any]:
        return {
            "sessions": len(self.sessions),
            "blocks": sum(len(s.blocks) for s in self.sessions.values()),
            "running": sum(len(s.running()) for s in self.sessions.values()),
        }
