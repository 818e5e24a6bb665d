"""Suite 6: fault injection. One coroutine misbehaves; every other coroutine must be served as if
nothing happened (same tokens as a clean run) and no memory may be lost."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from textwrap import fill
from typing import Any

from cothink.errors import InputTooLongError, PoolExhaustedError
from cothink.eval.common import SuiteContext, SuiteResult, Table, engine_idle_state, plan_params, within
from cothink.eval.plots import bars

NAME = "faults"
TITLE = "Fault injection: isolation and recovery"
QUESTION = (
    "When one coroutine fails (an exception in user code, a cancelled input, an over-long input, memory "
    "exhaustion, its block released mid-generation, an invalid token id), does the engine keep serving "
    "every other coroutine "
    "unchanged, and does it get all memory back?"
)
METHOD = (
    "V victim coroutines (chat prompts, greedy, fixed length) run concurrently with one faulty coroutine, on "
    "one long-lived engine that goes through every fault in turn (and on a second engine with a tiny KV pool "
    "for exhaustion). Victims' tokens are compared with a clean run without the fault. After each fault the "
    "faulty coroutine's blocks are released (as its `finally` would) and the engine must be back to its "
    "starting state: free pages, live blocks, running works. A request after all faults must still succeed."
)

TIMEOUT = 300.0


@dataclass(frozen=True, slots=True)
class FaultsPlan:
    """The suite's knobs (written verbatim into config.json and the suite's params)."""

    victims: int
    victim_tokens: int
    long_input: int
    max_input_tokens: int
    small_kv_tokens: int


@dataclass(frozen=True, slots=True)
class FaultRow:
    """One fault run: a row of raw/faults-<model>.csv."""

    fault: str
    victims_equal_clean: bool  # the other coroutines wrote exactly the clean run's tokens
    memory_returned: bool  # the engine's idle state afterwards equals the one before
    detail: str  # what happened, in words
    outcome: dict[str, Any] | None = None  # what the fault's own function reported
    victims_s: float | None = None  # the victims' wall time next to the fault
    served_after: bool | None = None  # a new request was served afterwards (None: not asked)

    @property
    def isolated(self) -> bool:
        """Others unaffected and memory returned."""
        return self.victims_equal_clean is True and self.memory_returned


def plan(quick: bool, duration: float | None = None) -> FaultsPlan:
    return FaultsPlan(
        victims=3,
        victim_tokens=10 if quick else 24,
        long_input=480,
        max_input_tokens=512,
        small_kv_tokens=512,
    )


def _estimate_raw(p: FaultsPlan, speed) -> float:
    per = p.victim_tokens * speed.step_s * (1 + 0.35 * p.victims) + 3 * 40 / speed.prefill_tps
    return 8 * per + 3 * p.long_input / speed.prefill_tps


def estimate_s(p: FaultsPlan, speed) -> float:
    """Seconds, from the calibrated speed; the factor was fitted to measured quick runs on a 2-core CPU."""
    return 1.2 * _estimate_raw(p, speed)


class Injected(Exception):
    """The exception a faulty user coroutine raises."""


def _prompts(ctx: SuiteContext, n: int) -> list[list[int]]:
    topics = ("rivers", "bread", "chess", "volcanoes", "bees", "glass", "comets", "tea")
    return [ctx.model.chat(f"Write one sentence about {topics[i % len(topics)]}.") for i in range(n)]


async def _victims(
    engine,
    prompts: list[list[int]],
    n_tokens: int,
    started: asyncio.Event | None = None,
    timing: list | None = None,
):
    """Run the victims concurrently; their outputs (and, into `timing`, their wall time)."""
    t0 = time.perf_counter()

    async def one(i: int, prompt: list[int]) -> list[int]:
        block = engine.block(f"victim-{i}")
        try:
            await engine.extend(block, token_ids=prompt, name=f"victim-{i}")
            out = []
            async for piece in engine.generate(
                block, max_tokens=n_tokens, stop_at_eos=False, name=f"victim-{i}"
            ):
                out.extend(piece.token_ids)
                if started is not None and len(out) >= 2:
                    started.set()
            return out
        finally:
            engine.release(block)

    outs = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    if timing is not None:
        timing.append(time.perf_counter() - t0)
    return outs


async def _fault_exception(engine, ctx, p, started):
    block = engine.block("faulty")
    try:
        await engine.extend(block, token_ids=ctx.model.chat("Count to twenty."), name="faulty")
        n = 0
        async for _ in engine.generate(block, max_tokens=100, stop_at_eos=False, name="faulty"):
            n += 1
            if n == 3:
                raise Injected("injected failure inside a user coroutine")
    finally:
        engine.release(block)


async def _fault_cancelled_extend(engine, ctx, p, started):
    block = engine.block("faulty")
    try:
        doc = ctx.model.encode("word " * p.long_input)[: p.long_input]
        task = asyncio.create_task(engine.extend(block, token_ids=doc, name="faulty"))
        t0 = time.perf_counter()
        while len(block) == 0 and not task.done() and time.perf_counter() - t0 < TIMEOUT:
            await asyncio.sleep(0.001)
        at_cancel = len(block)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await started.wait()
        for _ in range(5):  # a few more steps: does the cancelled prefill keep running?
            await asyncio.sleep(0.05)
        return {
            "written_at_cancel": at_cancel,
            "written_later": len(block),
            "requested": len(doc),
            "chunk": engine.limits.scheduler.max_prefill_chunk,
        }
    finally:
        engine.release(block)


async def _fault_overlong(engine, ctx, p, started):
    block = engine.block("faulty")
    forks = []
    outcome = {}
    try:
        before = engine.memory().used_pages
        try:
            await engine.extend(
                block, token_ids=ctx.model.encode("word " * (p.max_input_tokens + 50)), name="faulty"
            )
            outcome["input over max_input_tokens"] = "accepted"
        except InputTooLongError:
            outcome["input over max_input_tokens"] = "InputTooLongError"
        outcome["nothing written"] = len(block) == 0 and engine.memory().used_pages == before
        # a view longer than the model's context: forks of one block, side by side
        await engine.extend(block, token_ids=ctx.model.encode("word " * 400)[:400], name="faulty")
        while sum(len(b) for b in [block, *forks]) <= engine.runner.max_context:
            forks.append(engine.fork(block, f"faulty-fork-{len(forks)}"))
        try:
            await engine.probe([block, *forks], ctx.model.encode(" Answer:"), (" yes", " no"), name="faulty")
            outcome["view over max_context"] = "accepted"
        except InputTooLongError:
            outcome["view over max_context"] = "InputTooLongError"
        return outcome
    finally:
        for b in [*forks, block]:
            engine.release(b)


async def _fault_bad_token(ctx, p, prompts, reference) -> FaultRow:
    """Out-of-vocabulary token ids, on an engine of its own: the step loop must survive."""
    engine = ctx.model.engine(kv_tokens=4096)
    await engine.start()
    stop_error = None
    try:
        start = engine_idle_state(engine)
        block = engine.block("faulty")
        bad = asyncio.create_task(
            engine.extend(block, token_ids=[5, ctx.model.config.vocab_size + 10], name="faulty")
        )
        timing: list[float] = []
        victims = asyncio.create_task(_victims(engine, prompts, p.victim_tokens, timing=timing))
        t0 = time.perf_counter()
        while not victims.done() and engine.running and time.perf_counter() - t0 < TIMEOUT:
            await asyncio.sleep(0.01)
        loop_alive = engine.running
        if not victims.done():
            victims.cancel()
        if not bad.done():
            bad.cancel()
        outs, bad_outcome = await asyncio.gather(victims, bad, return_exceptions=True)
        try:
            engine.release(block)
        except Exception:
            pass
        end = engine_idle_state(engine)
        served_after = False
        if engine.running:
            served_after = bool(
                (await within(_victims(engine, prompts[:1], 2), TIMEOUT, "after bad tokens"))[0]
            )
    finally:
        try:
            await engine.stop()
        except Exception as exc:  # the step loop's own exception resurfaces here
            stop_error = type(exc).__name__
    bad_desc = (
        "accepted"
        if bad_outcome is None
        else "cancelled (never answered)"
        if isinstance(bad_outcome, asyncio.CancelledError)
        else type(bad_outcome).__name__
    )
    return FaultRow(
        fault="out-of-vocabulary token id",
        victims_equal_clean=outs == reference,
        memory_returned=end == start,
        served_after=served_after,
        detail=f"faulty extend -> {bad_desc}; engine step loop {'alive' if loop_alive else 'DIED'}"
        + (f" (Engine.stop() re-raised {stop_error})" if stop_error else ""),
    )


async def _fault_release_mid_generation(engine, ctx, p, started):
    block = engine.block("faulty")
    await engine.extend(block, token_ids=ctx.model.chat("Describe the sea."), name="faulty")
    gen = engine.generate(block, max_tokens=100, stop_at_eos=False, name="faulty")
    got = []

    async def consume():
        async for piece in gen:
            got.extend(piece.token_ids)

    task = asyncio.create_task(consume())
    while len(got) < 2 and not task.done():
        await asyncio.sleep(0.001)
    engine.release(block)  # the writer is cancelled, memory returns once nothing reads it
    await within(task, 60, "generation of a released block")
    return {"finish_reason": gen.result.finish_reason if gen.result else None, "tokens": len(got)}


FAULTS = {
    "exception in a user coroutine": _fault_exception,
    "cancelled extend (long input)": _fault_cancelled_extend,
    "over-long input": _fault_overlong,
    "block released mid-generation": _fault_release_mid_generation,
}


async def _pool_exhaustion(ctx, p, prompts, reference, mode: str) -> FaultRow:
    engine = ctx.model.engine(kv_tokens=p.small_kv_tokens, on_pool_full=mode, pool_wait_s=1.0)
    async with engine:
        start = engine_idle_state(engine)
        started = asyncio.Event()
        hog_block = engine.block("hog")

        async def hog():
            try:
                await engine.extend(
                    hog_block,
                    token_ids=ctx.model.encode("word " * p.long_input)[: p.long_input],
                    name="hog",
                )
                return "accepted"
            except PoolExhaustedError:
                return "PoolExhaustedError"
            finally:
                engine.release(hog_block)

        timing: list[float] = []
        outs, hog_outcome = await within(
            asyncio.gather(_victims(engine, prompts, p.victim_tokens, started, timing), hog()),
            TIMEOUT,
            f"pool exhaustion ({mode})",
        )
        await asyncio.sleep(0)
        end = engine_idle_state(engine)
        after = await within(_victims(engine, prompts[:1], 2), TIMEOUT, "request after the fault")
    return FaultRow(
        fault=f"pool exhaustion (on_pool_full={mode!r}, {p.small_kv_tokens}-token pool)",
        victims_equal_clean=outs == reference,
        memory_returned=end == start,
        served_after=bool(after[0]),
        detail=f"hog ({p.long_input} tokens) -> {hog_outcome}",
        victims_s=timing[0] if timing else None,
    )


async def run(ctx: SuiteContext, p: FaultsPlan) -> SuiteResult:
    res = SuiteResult(NAME, ctx.model.key, params=plan_params(p))
    prompts = _prompts(ctx, p.victims)
    engine = ctx.model.engine(kv_tokens=8192, max_input_tokens=p.max_input_tokens, max_context=2048)
    async with engine:
        ctx.say("clean run")
        clean_s: list[float] = []
        reference = await within(
            _victims(engine, prompts, p.victim_tokens, timing=clean_s), TIMEOUT, "clean run"
        )
        start = engine_idle_state(engine)
        rows: list[FaultRow] = []
        for name, fault in FAULTS.items():
            ctx.say(name)
            started = asyncio.Event()
            timing: list[float] = []
            victims, outcome = await within(
                asyncio.gather(
                    _victims(engine, prompts, p.victim_tokens, started, timing),
                    fault(engine, ctx, p, started),
                    return_exceptions=True,
                ),
                TIMEOUT,
                name,
            )
            await asyncio.sleep(0)
            end = engine_idle_state(engine)
            detail = (
                f"raised {type(outcome).__name__}"
                if isinstance(outcome, BaseException)
                else ", ".join(f"{k}={v}" for k, v in (outcome or {}).items())
            )
            rows.append(
                FaultRow(
                    fault=name,
                    victims_equal_clean=victims == reference,
                    memory_returned=end == start,
                    detail=detail,
                    outcome=outcome if isinstance(outcome, dict) else None,
                    victims_s=timing[0] if timing else None,
                )
            )
        ctx.say("request after all faults")
        timing = []
        after = await within(
            _victims(engine, prompts, p.victim_tokens, timing=timing), TIMEOUT, "request after faults"
        )
        rows.append(
            FaultRow(
                fault="(none: a clean request after all faults)",
                victims_equal_clean=after == reference,
                memory_returned=engine_idle_state(engine) == start,
                detail="",
                victims_s=timing[0],
            )
        )
    for mode in ("error", "wait"):
        ctx.say(f"pool exhaustion ({mode})")
        rows.append(await _pool_exhaustion(ctx, p, prompts, reference, mode))
    ctx.say("out-of-vocabulary token id")
    rows.append(await _fault_bad_token(ctx, p, prompts, reference))
    res.headline["clean_victims_s"] = clean_s[0]
    res.records = [asdict(r) for r in rows]
    _analyse(ctx, res, rows)
    return res


def _analyse(ctx: SuiteContext, res: SuiteResult, rows: list[FaultRow]) -> None:
    labels = ["clean run"] + [r.fault.split(" (")[0] for r in rows]
    values = [res.headline.get("clean_victims_s", 0.0)] + [r.victims_s or 0.0 for r in rows]
    bars(
        ctx.plot_path(NAME, "victims"),
        f"{ctx.model.key}: victims' wall time next to each fault (0 = never finished)",
        [fill(x, 14) for x in labels],
        [("seconds", values)],
        "seconds",
    )
    res.plots.append(ctx.plot_path(NAME, "victims").name)
    table = [
        [
            r.fault,
            "yes" if r.victims_equal_clean else "NO",
            "yes" if r.memory_returned else "NO",
            r.detail,
        ]
        for r in rows
    ]
    res.tables.append(
        Table(
            "Faults",
            ["fault", "other coroutines' output == clean run", "memory back to start", "what happened"],
            table,
        )
    )
    for r in rows:
        res.check(f"{r.fault}: others unaffected and memory returned", r.isolated, r.detail)
    ce = next((r.outcome for r in rows if r.fault.startswith("cancelled extend")), None)
    if ce:
        # Cancellation reaches the task at its next await, so one more step (one chunk) may land.
        stopped = ce["written_later"] - ce["written_at_cancel"] <= ce["chunk"]
        res.check(
            "a cancelled extend stops within one step (at most one more prefill chunk)",
            stopped,
            f"{ce['written_at_cancel']} of {ce['requested']} tokens written at cancellation, "
            f"{ce['written_later']} a few steps later (chunk {ce['chunk']})",
        )
    ol = next((r.outcome for r in rows if r.fault == "over-long input"), None)
    if ol:
        res.check(
            "over-long input and over-long views are refused with InputTooLongError, nothing written",
            ol["input over max_input_tokens"] == "InputTooLongError"
            and ol["nothing written"]
            and ol["view over max_context"] == "InputTooLongError",
            str(ol),
        )
    for r in rows:
        if r.served_after is not None:
            res.check(f"{r.fault}: the engine still serves a new request afterwards", r.served_after)
    exh = [r for r in rows if r.fault.startswith("pool exhaustion")]
    bad = [r.fault for r in rows if not r.isolated]
    res.summary = (
        f"{len(rows) - 1} faults: others unaffected and memory returned in "
        f"{len(rows) - len(bad)}/{len(rows)} runs" + (f"; failing: {', '.join(bad)}" if bad else "")
    )
    res.headline.update(
        {
            "faults": len(rows) - 1,
            "all_isolated": all(r.victims_equal_clean for r in rows),
            "all_memory_returned": all(r.memory_returned for r in rows),
            "pool_exhaustion": "; ".join(r.detail for r in exh),
        }
    )
    res.conditions += [
        f"{res.params['victims']} victims x {res.params['victim_tokens']} greedy tokens; one fault at a "
        "time; the "
        "faulty coroutine releases its blocks in `finally` (an application that never releases a block "
        "keeps "
        f"its memory: the engine cannot know it is garbage)",
        f"pool exhaustion on a {res.params['small_kv_tokens']}-token pool (pages of 16 tokens) with a "
        f"{res.params['long_input']}-token input; victims decode first within a priority class, so they keep "
        "their pages",
    ]
