"""Streamed input: speech-recognition-like pieces appended to a block while a thinker generates.

A listener coroutine receives an utterance piece by piece: half-words, one every `piece_s` seconds, on
the speaker's clock (a piece never waits for the engine). Each piece's token ids are appended to the
utterance's block; pieces that arrive while an append is still running are appended together by the
next one (a block has one writer at a time), as an application buffering a recogniser's output would.
After the last piece the listener answers (an interactive generation over the utterance). A background
thinker keeps generating throughout, so every piece competes with it for steps.

Measured per utterance: time from the last piece's arrival to the answer's first token, the listener's
tokens per step that absorbed input, the appends, and whether the block holds exactly the pieces'
tokens in arrival order.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from cothink.eval.common import within
from cothink.eval.workload import filler_words

TIMEOUT = 600.0


@dataclass(frozen=True, slots=True)
class StreamPlan:
    utterances: int  # utterances, one after another
    words: int  # words per utterance (each arrives as two pieces when longer than 3 letters)
    piece_s: float  # seconds between pieces
    answer_tokens: int  # the listener's answer after the last piece
    thinker_tokens: int  # tokens per thinker job (it starts a new job when one ends)


@dataclass(frozen=True, slots=True)
class UtteranceRow:
    """One utterance: a row of the streamed-input table (seconds)."""

    utterance: int
    pieces: int
    piece_tokens: int  # tokens of all its pieces
    appends: int  # extend calls that carried them (fewer than pieces when pieces queued up)
    absorbed_in_order: bool  # the block holds exactly the head and every piece's tokens, in arrival order
    absorb_steps: int  # engine steps that carried the listener's input
    tokens_per_step_mean: float  # of the listener's input, over those steps
    tokens_per_step_max: int
    stream_s: float  # first piece -> last piece arrival
    last_piece_to_answer_s: float  # last piece's arrival -> first token of the answer (NaN: no answer)
    thinker_tokens_during: int  # tokens the thinker generated between the first and the last piece
    error: str = ""  # what went wrong, if anything


def utterance_pieces(rng: random.Random, words: int) -> list[str]:
    """The utterance as a recogniser emits it: each word longer than 3 letters in two halves."""
    pieces = []
    for word in filler_words(rng, words).split():
        text = " " + word
        cut = len(text) // 2 if len(word) > 3 else len(text)
        pieces += [text[:cut], text[cut:]] if cut < len(text) else [text]
    return pieces


@dataclass
class _Thinker:
    """A background coroutine that keeps generating (new job when one ends) until stopped."""

    engine: Any
    prompt: list[int]
    tokens: int
    times: list[float] = field(default_factory=list)  # arrival time of every token
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        while not self.stop.is_set():
            block = self.engine.block("thinker")
            try:
                await self.engine.extend(block, token_ids=self.prompt, name="thinker", priority="background")
                async for piece in self.engine.generate(
                    block, max_tokens=self.tokens, stop_at_eos=False, name="thinker", priority="background"
                ):
                    self.times.extend([time.perf_counter()] * len(piece.token_ids))
                    if self.stop.is_set():
                        break
            finally:
                self.engine.release(block)


async def _utterance(
    model: Any, engine: Any, p: StreamPlan, u: int, pieces: list[list[int]], thinker: _Thinker
) -> UtteranceRow:
    name = f"listener{u}"
    head = model.encode("Transcript of what the user is saying:")
    block = engine.block(name)
    queue: asyncio.Queue[list[int] | None] = asyncio.Queue()
    arrivals: list[float] = []
    appended: list[int] = []
    appends = 0

    async def speaker() -> None:
        for ids in pieces:
            await asyncio.sleep(p.piece_s)
            arrivals.append(time.perf_counter())
            queue.put_nowait(ids)
        queue.put_nowait(None)

    async def absorber() -> None:
        nonlocal appends
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            ids = [t for piece in batch if piece is not None for t in piece]
            if ids:
                await engine.extend(block, token_ids=ids, name=name, priority="interactive")
                appended.extend(ids)
                appends += 1
            if batch[-1] is None:
                return

    first_token = float("nan")
    error = ""
    try:
        await engine.extend(block, token_ids=head, name=name, priority="interactive")
        await within(asyncio.gather(speaker(), absorber()), TIMEOUT, f"utterance {u}")
        in_order = list(block.tokens) == head + [t for ids in pieces for t in ids] and appended == [
            t for ids in pieces for t in ids
        ]
        async for piece in engine.generate(
            block, max_tokens=p.answer_tokens, stop_at_eos=False, name=name, priority="interactive"
        ):
            if piece.token_ids:
                first_token = time.perf_counter()
                break
    except Exception as exc:  # recorded: the suite's check reports it
        in_order, error = False, f"{type(exc).__name__}: {exc}"
    finally:
        engine.release(block)
    steps = [
        sum(i.tokens for i in s.items if i.coroutine == name and i.kind == "extend")
        for s in list(engine.timeline)
    ]
    steps = [n for n in steps if n > 0][1:]  # the head's step is not streamed input
    t_first, t_last = (arrivals[0], arrivals[-1]) if arrivals else (float("nan"), float("nan"))
    return UtteranceRow(
        utterance=u,
        pieces=len(pieces),
        piece_tokens=sum(len(ids) for ids in pieces),
        appends=appends,
        absorbed_in_order=in_order,
        absorb_steps=len(steps),
        tokens_per_step_mean=sum(steps) / len(steps) if steps else float("nan"),
        tokens_per_step_max=max(steps, default=0),
        stream_s=t_last - t_first,
        last_piece_to_answer_s=first_token - t_last,
        thinker_tokens_during=sum(1 for t in thinker.times if t_first <= t <= t_last),
        error=error,
    )


async def run_streamed(model: Any, p: StreamPlan, seed: int) -> list[UtteranceRow]:
    """Every utterance in turn, on one fresh engine, while a background thinker generates."""
    engine = model.engine(kv_tokens=4096)
    rng = random.Random(seed)
    thinker = _Thinker(
        engine,
        model.chat("Think step by step about how to schedule a week of plant maintenance."),
        p.thinker_tokens,
    )
    rows = []
    async with engine:
        task = asyncio.create_task(thinker.run())
        try:
            t0 = time.perf_counter()
            while not thinker.times and time.perf_counter() - t0 < 120:
                await asyncio.sleep(0.01)  # the thinker is generating before the first piece arrives
            for u in range(p.utterances):
                pieces = [model.encode(text) for text in utterance_pieces(rng, p.words)]
                rows.append(await _utterance(model, engine, p, u, pieces, thinker))
        finally:
            thinker.stop.set()
            await within(task, TIMEOUT, "thinker")
    return rows
