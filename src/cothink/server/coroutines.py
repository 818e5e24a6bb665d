"""A session's coroutines: extend, generate and probe calls on its blocks, each entered once, the same
way, through `coroutine_entry`.

The checks of a call's arguments belong to the engine (cothink.runtime.engine, at its boundary):
what is checked here is the server's own policy (quotas and request limits).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from cothink.observability.logs import coroutine_var
from cothink.server.errors import APIError, from_exception
from cothink.server.journal import JournalWriteError, journal_unavailable
from cothink.server.openai_features import structured_for
from cothink.server.schemas import ExtendRequest, GenerateRequest, ProbeRequest, ProbeResult
from cothink.server.sessions import BlockEntry, CoroutineEntry, Session
from cothink.server.state import ServerState
from cothink.server.vision_parts import VisualInput, visual_input

if TYPE_CHECKING:
    from cothink.runtime.engine import Generation


@dataclass(frozen=True)
class Entered:
    """A coroutine inside its entry: its session record and its span (current in the body)."""

    co: CoroutineEntry
    span: trace.Span


@contextlib.contextmanager
def coroutine_entry(
    state: ServerState,
    session: Session,
    kind: str,
    name: str | None,
    view: list[BlockEntry],
    writes: BlockEntry | None = None,
    tokens: int = 0,
    attributes: dict[str, Any] | None = None,
    outlives_entry: bool = False,
    params: dict[str, Any] | None = None,
) -> Iterator[Entered]:
    """Register a `kind` coroutine of `session` reading `view` and run the body under its span.

    A writer (`writes`: the block it adds to) first reserves `tokens` against the session's and the
    key's quotas; the reservation goes when the coroutine finishes. Leaving the body normally finishes
    the coroutine ('done') and ends its span, unless it `outlives_entry` (a generation: its `Running`
    finishes both). Leaving it by an exception records the coroutine as failed (its error: the
    APIError's message, or 'cancelled'; a failed generation's finish reason is 'error'), so a failed
    entry leaves nothing running and nothing reserved.

    A writer is journaled (with `params`, a generation's sampling parameters) before the body runs:
    the tokens written after that record are the coroutine's.
    """
    reservation = session.reserve(writes, tokens) if writes is not None else None
    try:
        co = session.new_coroutine(kind, name, [v.id for v in view], writes.id if writes else None, tokens)
    except BaseException:
        if reservation is not None:
            reservation.release()
        raise
    co.reservation = reservation
    state.own(co.id, session.account)
    coroutine_var.set(co.id)
    span = state.tracer.start_span(
        f"cothink.session.{kind}",
        attributes={
            "cothink.session": session.id,
            "cothink.coroutine": co.id,
            **({"cothink.block": writes.id} if writes is not None else {}),
            "cothink.view": [v.id for v in view],
            **(attributes or {}),
        },
    )
    try:
        with trace.use_span(span, end_on_exit=False):  # the engine work's span nests under this one
            if writes is not None:
                session.manager.journal.work_started(session, co, params)
            yield Entered(co, span)
    except BaseException as exc:
        error = from_exception(exc).message if isinstance(exc, Exception) else "cancelled"
        session.finish(co, "failed", "error" if kind == "generate" else None, error)
        span.set_attribute("cothink.error", error)
        span.end()
        raise
    if not outlives_entry:
        session.finish(co, "finished", "done")
        span.end()


# ---------------------------------------------------------------------------------------- extend


async def input_ids(state: ServerState, text: str | None, token_ids: list[int] | None) -> list[int]:
    """The tokens of an extend's input (text tokenized off the event loop when large). The engine
    checks them; an empty input is refused here only to name the request's field ('text' or
    'token_ids': the engine sees token ids either way)."""
    param = "text" if text is not None else "token_ids"
    ids = await state.encode(text, "text") if text is not None else list(token_ids or [])
    if not ids:
        raise APIError(400, "the input is empty", "invalid_request_error", "empty_input", param)
    return ids


async def do_extend(
    state: ServerState,
    session: Session,
    entry: BlockEntry,
    ids: list[int],
    view_ids: list[str] | None = None,
    priority: str | None = None,
    name: str | None = None,
    visual: VisualInput | None = None,
) -> None:
    """Write `ids` into `entry`'s block under `view_ids` (default: the block alone; the engine
    checks that the view ends with it). With `visual`, an image or frame group instead (`ids`
    ignored)."""
    state.check_open()
    view = session.view(view_ids) if view_ids is not None else [entry]
    data: dict[str, Any] = {"token_ids": ids} if visual is None else visual.engine_input
    count = len(ids) if visual is None else visual.tokens
    with coroutine_entry(
        state, session, "extend", name, view, entry, count, {"cothink.tokens": count}
    ) as entered:
        await state.wait(
            state.engine.extend(
                entry.block,
                **data,
                view=[v.block for v in view],
                priority=priority,
                name=entered.co.id,
            )
        )
        session.manager.journal.acknowledge(session, entry.block)  # on file before the reply


async def extend_from(state: ServerState, session: Session, entry: BlockEntry, body: ExtendRequest) -> None:
    """An extend request's input (text, token ids, an image or a frame group) written into `entry`."""
    if body.image is not None or body.frames is not None:
        visual = await visual_input(state, body.image, body.frames, body.timestamp)
        await do_extend(state, session, entry, [], body.view, body.priority, body.name, visual)
    else:
        ids = await input_ids(state, body.text, body.token_ids)
        await do_extend(state, session, entry, ids, body.view, body.priority, body.name)


# ---------------------------------------------------------------------------------------- generate


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
        self,
        state: ServerState,
        session: Session,
        co: CoroutineEntry,
        gen: Generation,
        span: trace.Span,
        prompt_tokens: int,
    ):
        self.state, self.session, self.co, self.gen, self.span = state, session, co, gen, span
        self.prompt_tokens = prompt_tokens
        self.error: APIError | None = None

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """start, token..., then end (or error). Leaving early cancels the generation.

        One token event per engine Piece: every token of the result arrives in one, the final token
        included (the Piece protocol, scheduler/work.py GenerateWork), so the token events add up to
        the end event's text and token ids."""
        co, session = self.co, self.session
        journal, written = session.manager.journal, session.blocks.get(co.block or "")
        block = written.block if written is not None else None
        unjournaled: JournalWriteError | None = None
        yield {"type": "start", "coroutine": co.id, "block": co.block, "view": co.view}
        try:
            async for piece in self.gen:
                if unjournaled is not None:
                    continue  # cancelled: its last pieces are dropped, as is their memory below
                try:
                    if block is not None:
                        journal.catch_up(block)  # every token is on file before it is sent
                except JournalWriteError as exc:
                    unjournaled = exc
                    self.gen.cancel()
                    continue
                co.text += piece.text
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
            if unjournaled is not None:
                if block is not None:
                    journal.rewind(block)  # the block holds only what the journal holds
                raise journal_unavailable(unjournaled)
            result = self.gen.result
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
    """Start generating into the view's last block; the returned Running streams it."""
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
    state.check_context(sum(v.block.length for v in view), req.max_tokens)
    with coroutine_entry(
        state,
        session,
        "generate",
        req.name,
        view,
        view[-1],
        req.max_tokens,
        {"cothink.max_tokens": req.max_tokens},
        outlives_entry=True,
        params=req.model_dump(exclude={"view", "name", "stream", "background"}),
    ) as entered:
        structured = structured_for(state, req.response_format, [], None)
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
            name=entered.co.id,
            stop_at_eos=req.stop_at_eos,
            logprobs=req.logprobs,
            constraint=structured.make_constraint() if structured.make_constraint else None,
        )
        entered.co.generation = gen
    return Running(state, session, entered.co, gen, entered.span, sum(v.block.length for v in view))


# ---------------------------------------------------------------------------------------- probe


async def do_probe(state: ServerState, session: Session, req: ProbeRequest) -> ProbeResult:
    """Read the question after the view in a scratch block; the probability of each choice."""
    state.check_open()
    view = session.view(req.view)
    question = await state.encode(req.question, "question") if isinstance(req.question, str) else req.question
    if len(req.choices) > state.settings.max_probe_choices:
        raise APIError(
            400,
            f"at most {state.settings.max_probe_choices} choices",
            "invalid_request_error",
            "too_many_choices",
            "choices",
        )
    with coroutine_entry(
        state, session, "probe", req.name, view, attributes={"cothink.choices": list(req.choices)}
    ) as entered:
        probs = await state.wait(
            state.engine.probe(
                [v.block for v in view],
                question,
                tuple(req.choices),
                priority=req.priority,
                name=entered.co.id,
            )
        )
        answer = max(probs, key=probs.get)
        entered.co.text = answer
        entered.span.set_attribute("cothink.answer", answer)
    return ProbeResult(coroutine=entered.co.id, probabilities=probs, answer=answer)
