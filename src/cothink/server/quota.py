"""Memory quotas in one place: what each API key (and each session) holds and has reserved, in KV pages.

A block costs whole pages (at least one, even when it holds one token), so quotas are counted in pages,
not tokens. Every block the server creates is charged to an account (the caller's key) and, for the
session API, to a session. Running works reserve what they may still add (an extend: its input; a
generation: its `max_tokens`) *before* they start, in one synchronous check-and-add, so concurrent
requests cannot all pass a check that only one of them fits.

    projected tokens(block) = length + what its running works may still add
    pages(block)            = max(1, ceil(projected / page_size)) - pages it shares with its fork parent

A block stays charged until its memory is really free: releasing a block that a running work still
reads (a generation's view) keeps its pages counted against the account until the engine frees it.

The accounts' limits never promise more than the pool (`ServerSettings.memory_share`: the shares of
all keys add up to at most 1), and pages the server holds for no account (the prefix cache's forks)
are given back as soon as the promises need them (`make_room`), so a request within its account's
share finds room in the pool instead of waiting for it.

`MemoryLedger` is the only place in the server that knows how pages are counted; what fits the pool
itself is the engine's admission (`scheduler/budget.py::MemoryBudget`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cothink.server.errors import APIError

if TYPE_CHECKING:
    from cothink.memory.block import Block


@dataclass(frozen=True)
class PoolGeometry:
    """The KV pool as the server sees it through `engine.memory()`."""

    total_pages: int
    page_size: int
    bytes_per_page: int  # 0 for models without attention layers (no KV pages)

    def pages_for(self, tokens: int) -> int:
        return max(1, math.ceil(tokens / self.page_size))


@dataclass(eq=False)
class Charge:
    """A block charged to an account (and a session, for the session API)."""

    block: Block
    account: str
    session: str | None
    shared_pages: int = 0  # whole pages shared with the block it was forked from, while that one lives
    parent: Charge | None = None
    reserved: int = 0  # tokens running works may still add, as of `base`
    base: int = 0  # block length when `reserved` was set
    released: bool = False  # the session let go of it; it counts until a work stops reading it too

    def projected_tokens(self) -> int:
        length = 0 if self.block.freed else self.block.length
        grown = max(0, length - self.base)
        return length + max(0, self.reserved - grown)

    def pages(self, geometry: PoolGeometry) -> int:
        shared = self.shared_pages if self.parent is not None and not self.parent.block.freed else 0
        return max(geometry.pages_for(self.projected_tokens()) - shared, 1 if not shared else 0)


@dataclass(eq=False)
class Reservation:
    """Tokens promised to one running work on one block; `release()` when the work ends."""

    ledger: MemoryLedger
    charge: Charge
    tokens: int
    released: bool = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        c = self.charge
        length = 0 if c.block.freed else c.block.length
        # what is left of this reservation stops counting; what it wrote is now in the block's length
        remaining = max(0, c.reserved - max(0, length - c.base))
        c.reserved = max(0, remaining - self.tokens)
        c.base = length


@dataclass(eq=False)
class Hold:
    """Pages held for a whole request (OpenAI routes: prompts, forks and every choice's max_tokens),
    admitted as a unit; `release()` when the request ends."""

    account: str
    pages: int
    released: bool = False

    def release(self) -> None:
        self.released = True


@dataclass
class Usage:
    pages: int
    tokens: int
    blocks: int


@dataclass
class MemoryLedger:
    geometry: PoolGeometry
    account_max_pages: int | None  # None: only the pool bounds an account
    session_max_tokens: int | None
    charges: dict[int, Charge] = field(default_factory=dict)  # block id -> charge
    holds: list[Hold] = field(default_factory=list)
    # gives back pages held for no account until at most this many such pages remain (prefix cache)
    make_room: Callable[[int], object] | None = None

    # ---- views --------------------------------------------------------------------------------
    def _select(self, account: str | None = None, session: str | None = None) -> list[Charge]:
        for block_id in [i for i, c in self.charges.items() if c.released and c.block.freed]:
            del self.charges[block_id]  # really free now: its pages are back in the pool
        return [
            c
            for c in self.charges.values()
            if (account is None or c.account == account) and (session is None or c.session == session)
        ]

    def usage(self, account: str | None = None, session: str | None = None) -> Usage:
        charges = self._select(account, session)
        self.holds = [h for h in self.holds if not h.released]
        held = 0
        if session is None:
            held = sum(h.pages for h in self.holds if account is None or h.account == account)
        return Usage(
            pages=sum(c.pages(self.geometry) for c in charges) + held,
            tokens=sum(c.projected_tokens() for c in charges),
            blocks=len(charges),
        )

    def admit(self, account: str, pages: int, what: str) -> Hold:
        """Hold `pages` for a whole request at once, or refuse it (413: never fits; 429: over quota)."""
        self.check_request(pages, what)
        self._check(account, None, pages, 0, what)
        hold = Hold(account, pages)
        self.holds.append(hold)
        self._promised()
        return hold

    def budget_pages(self) -> int:
        """The most pages one account can ever hold."""
        limit = self.geometry.total_pages
        return min(limit, self.account_max_pages) if self.account_max_pages is not None else limit

    # ---- charging -----------------------------------------------------------------------------
    def add_block(
        self,
        block: Block,
        account: str,
        session: str | None,
        fork_of: Block | None = None,
        shared_pages: int | None = None,
    ) -> Charge:
        """Charge a new (empty, forked or restored) block; raises 429/413 when the account cannot hold
        it. A fork shares `fork_of`'s whole pages (`shared_pages` of them when given: a block restored
        as a fork of another restored block shares its leading pages only)."""
        parent = self.charges.get(fork_of.id) if fork_of is not None else None
        shared = 0
        if fork_of is not None:
            shared = shared_pages if shared_pages is not None else fork_of.length // self.geometry.page_size
        charge = Charge(block, account, session, shared_pages=shared if parent else 0, parent=parent)
        # a fork holds its parent's tokens (its length, as forked); a restored block holds its own
        extra_tokens = block.length
        self.check_request(charge.pages(self.geometry), "a new block")
        self._check(account, session, charge.pages(self.geometry), extra_tokens, what="a new block")
        self.charges[block.id] = charge
        self._promised()
        return charge

    def drop_block(self, block: Block) -> None:
        """The session released `block`: its pages stop counting once the engine frees it (at once
        unless a running work still reads it)."""
        charge = self.charges.get(block.id)
        if charge is None:
            return
        if block.freed:
            del self.charges[block.id]
        else:
            charge.released = True

    def check_fits(self, account: str, session: str | None, pages: int, tokens: int, what: str) -> None:
        """Refuse (413/429) what `account` (and `session`) could not take in: `pages` more pages and
        `tokens` more tokens. Nothing is charged: blocks are charged when they are added."""
        self.check_request(pages, what)
        self._check(account, session, pages, tokens, what)

    def _promised(self) -> None:
        """Pages held for no account (the prefix cache) give way to what the accounts were promised."""
        if self.make_room is not None:
            self.make_room(max(0, self.geometry.total_pages - self.usage().pages))

    def reserve(self, block: Block, tokens: int) -> Reservation:
        """Reserve `tokens` that a work is about to add to `block` (check and add in one step)."""
        charge = self.charges[block.id]
        before = charge.pages(self.geometry)
        saved = (charge.reserved, charge.base)
        length = 0 if block.freed else block.length
        remaining = max(0, charge.reserved - max(0, length - charge.base))
        charge.reserved, charge.base = remaining + tokens, length
        after = charge.pages(self.geometry)
        charge.reserved, charge.base = saved
        self.check_request(after, f"the block with {tokens} more tokens")
        self._check(charge.account, charge.session, after - before, tokens, what=f"{tokens} more tokens")
        charge.reserved, charge.base = remaining + tokens, length
        self._promised()
        return Reservation(self, charge, tokens)

    def check_request(self, pages: int, what: str) -> None:
        """Refuse at once a request that needs more pages than one account can ever hold."""
        budget = self.budget_pages()
        if pages > budget:
            g = self.geometry
            raise APIError(
                413,
                f"{what} needs {pages} KV pages ({pages * g.page_size} tokens, "
                f"{pages * g.bytes_per_page} bytes); one API key can hold at most {budget} pages "
                f"({budget * g.page_size} tokens, {budget * g.bytes_per_page} bytes) of this server's "
                f"{g.total_pages}",
                "invalid_request_error",
                "exceeds_memory_budget",
            )

    def _check(self, account: str, session: str | None, more_pages: int, more_tokens: int, what: str) -> None:
        if session is not None and self.session_max_tokens is not None:
            used = self.usage(session=session).tokens
            if used + more_tokens > self.session_max_tokens:
                raise APIError(
                    429,
                    f"session token quota exceeded: {used} used + {more_tokens} requested > "
                    f"{self.session_max_tokens}",
                    "quota_error",
                    "session_token_quota",
                )
        if self.account_max_pages is not None and more_pages > 0:
            used = self.usage(account=account).pages
            if used + more_pages > self.account_max_pages:
                g = self.geometry
                raise APIError(
                    429,
                    f"memory quota of this API key exceeded: {used} KV pages held or reserved + "
                    f"{more_pages} for {what} > {self.account_max_pages} pages "
                    f"({self.account_max_pages * g.bytes_per_page} bytes); release blocks or sessions",
                    "quota_error",
                    "key_memory_quota",
                )
