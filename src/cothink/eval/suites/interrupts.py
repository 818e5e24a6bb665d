"""Suite 3: interruptions. Scripted timelines: barge-in, input arriving mid-reasoning, cancel-and-resume.

Each scenario checks that background work continues, that memory (context) is intact afterwards (the
next-token logits of the final view equal a fresh recomputation of the same tokens on a new engine),
measures the time from interruption to the first reaction, and guards every wait with a timeout
(a timeout = a deadlock, reported as a failure).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

import torch

from cothink.errors import BlockBusyError
from cothink.eval.common import (
    Deadlock,
    SuiteContext,
    SuiteResult,
    Table,
    engine_idle_state,
    fmt,
    plan_params,
    within,
)
from cothink.eval.plots import bars

NAME = "interrupts"
TITLE = "Interruption and recovery"
QUESTION = (
    "When the foreground is interrupted (user barge-in, new input while reasoning, cancel and resume), does "
    "background work continue, is the context intact afterwards, how fast is the first reaction, and can "
    "anything deadlock?"
)
METHOD = (
    "Three scripted timelines on one engine per scenario. **barge-in**: a thinker reasons in the background "
    "while a narrator speaks; the user barges in: the narrator's task is cancelled, the user's words are "
    "appended to a user block and a reply starts (reading context, thinker, what was narrated, user). "
    "**input mid-reasoning**: new input arrives for a block that is being generated into; appending directly "
    "must be refused at once (BlockBusyError, not a hang); the protocol is cancel -> extend -> resume. "
    "**cancel-and-resume**: a generation is cancelled after k tokens, another coroutine runs meanwhile, then "
    "it resumes; with greedy decoding the tokens must equal an uninterrupted run. Context intact = the "
    "next-token logits after the final view equal those of a fresh engine fed the same tokens as one "
    "sequence. Reaction time = interruption -> first token of the reaction. Every wait has a timeout."
)

TIMEOUT = 300.0


@dataclass(frozen=True, slots=True)
class InterruptsPlan:
    """The suite's knobs (written verbatim into config.json and the suite's params)."""

    narration_tokens_before: int
    reply_tokens: int
    thinker_tokens: int
    resume_at: int
    resume_total: int
    repeats: int


@dataclass(frozen=True, slots=True)
class LogitCheck:
    """Next-token logits after live views against a fresh engine fed the same tokens as one sequence;
    over several views, the worst one."""

    max_abs_diff: float  # max |live - fresh| over the vocabulary
    rel_diff: float  # max_abs_diff / max |fresh logit|
    argmax_equal: bool  # the same next token (over several views: in every one)
    tokens: int  # tokens of the view
    views: int = 1  # views checked


@dataclass(frozen=True, slots=True)
class BargeIn:
    """One barge-in run: a row of raw/interrupts-<model>.csv."""

    scenario: ClassVar[str] = "barge-in"
    reaction_s: float  # the user barges in -> the reply's first token
    thinker_tokens_before: int  # thinker tokens delivered before the barge-in
    thinker_tokens_after: int  # and after it
    thinker_finish: str  # the thinker's finish reason ("cancelled": it was stopped)
    delivered_is_prefix: bool  # the delivered narration is the start of what the narration block holds
    undelivered: int  # narration tokens written to the block but never delivered
    narrated_tokens: int  # narration tokens delivered
    logits: LogitCheck  # views [context, thinker] and [context, narration]
    memory_returned: bool  # the engine's idle state afterwards equals the one before
    repeat: int  # which run of the scenario

    def progress(self) -> str:
        """The background thinker, for the table."""
        return (
            f"{self.thinker_tokens_before} before, {self.thinker_tokens_after} after ({self.thinker_finish})"
        )

    def other(self) -> str:
        return f"narration: {self.narrated_tokens} delivered, {self.undelivered} written but not delivered"


@dataclass(frozen=True, slots=True)
class InputMidReasoning:
    """One input-mid-reasoning run: a row of raw/interrupts-<model>.csv."""

    scenario: ClassVar[str] = "input mid-reasoning"
    reaction_s: float  # the input arrives -> the resumed reasoning's first token
    direct_append: str  # what appending to the busy block did: "BlockBusyError" or "accepted"
    refusal_s: float  # how long that took
    tokens_before_input: int  # reasoning tokens before the input
    tokens_after_input: int  # and after it
    generated_tokens_kept: bool  # the reasoning before the input is still at the end of the block
    supplement_in_place: bool  # the input landed right after it
    logits: LogitCheck  # view [problem, reasoning]
    memory_returned: bool  # the engine's idle state afterwards equals the one before
    repeat: int  # which run of the scenario

    def progress(self) -> str:
        """The reasoning, for the table."""
        return f"{self.tokens_before_input} before, {self.tokens_after_input} after"

    def other(self) -> str:
        return (
            f"direct append -> {self.direct_append} in {self.refusal_s * 1000:.1f} ms; supplement in place: "
            f"{fmt(self.supplement_in_place)}"
        )


@dataclass(frozen=True, slots=True)
class CancelResume:
    """One cancel-and-resume run: a row of raw/interrupts-<model>.csv."""

    scenario: ClassVar[str] = "cancel-and-resume"
    reaction_s: float  # resume -> its first token
    cancel_s: float  # how long the cancellation took
    tokens_at_cancel: int  # tokens the generation had written when cancelled
    delivered_at_cancel: int  # and delivered
    delivered_is_prefix: bool  # the delivered tokens are the start of what was written
    undelivered: int  # written but never delivered
    resumed_equals_uninterrupted: bool  # the whole output equals an uninterrupted greedy run's
    agreeing_tokens: str  # "<agreeing>/<total>" against the uninterrupted run
    logits: LogitCheck  # view [block]
    memory_returned: bool  # the engine's idle state afterwards equals the one before
    repeat: int  # which run of the scenario

    def progress(self) -> str:
        """The interrupted generation, for the table."""
        return (
            f"cancelled at {self.tokens_at_cancel} written / {self.delivered_at_cancel} delivered, "
            f"cancel took {self.cancel_s * 1000:.1f} ms"
        )

    def other(self) -> str:
        return f"resumed == uninterrupted: {fmt(self.resumed_equals_uninterrupted)} ({self.agreeing_tokens})"


ScenarioRow = BargeIn | InputMidReasoning | CancelResume


def record(row: ScenarioRow) -> dict[str, Any]:
    """A run's row as written: the scenario first, the logit check's fields as logits_<field>."""
    out: dict[str, Any] = {"scenario": row.scenario}
    for key, value in asdict(row).items():
        if key == "logits":
            out.update({f"logits_{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def plan(quick: bool, duration: float | None = None) -> InterruptsPlan:
    if quick:
        return InterruptsPlan(
            narration_tokens_before=6,
            reply_tokens=8,
            thinker_tokens=24,
            resume_at=8,
            resume_total=20,
            repeats=1,
        )
    return InterruptsPlan(
        narration_tokens_before=12,
        reply_tokens=24,
        thinker_tokens=64,
        resume_at=16,
        resume_total=48,
        repeats=3,
    )


def estimate_s(p: InterruptsPlan, speed) -> float:
    steps = p.thinker_tokens + p.reply_tokens + 2 * p.resume_total + 20
    return p.repeats * (steps * speed.step_s * 1.5 + 900 / speed.prefill_tps + 3 * 300 / speed.prefill_tps)


def _logit_check(ctx: SuiteContext, engine, views: list[list], probe_token: int) -> LogitCheck:
    """Worst case over views of `_logit_check_one`."""
    checks = [_logit_check_one(ctx, engine, v, probe_token) for v in views]
    worst = max(checks, key=lambda c: c.max_abs_diff)
    return replace(worst, argmax_equal=all(c.argmax_equal for c in checks), views=len(views))


def _logit_check_one(ctx: SuiteContext, engine, view: list, probe_token: int) -> LogitCheck:
    """Next-token logits after `view` (+ one probe token) on the live engine vs a fresh one.

    Only meaningful for a view whose blocks were each written under (a prefix of) this same view: a
    block written while an earlier block of the view was still growing saw that block shorter, and its
    memory is, by design, what it saw then, not what a recomputation over the final content gives."""
    runner = engine.runner
    scratch = runner.new_block("logit-check")
    try:
        live = runner.extend(scratch, [probe_token], view=[*view, scratch], logits="last")[-1]
    finally:
        runner.free(scratch)
    fresh_runner = ctx.model.new_runner(kv_tokens=sum(len(b) for b in view) + 64)
    block = fresh_runner.new_block("replay")
    tokens = [t for b in view for t in b.tokens]
    fresh = fresh_runner.extend(block, tokens + [probe_token], logits="last")[-1]
    diff = float((live - fresh).abs().max())
    scale = float(fresh.abs().max())
    return LogitCheck(
        max_abs_diff=diff,
        rel_diff=diff / scale if scale else diff,
        argmax_equal=int(live.argmax()) == int(fresh.argmax()),
        tokens=len(tokens),
    )


def _tol(ctx: SuiteContext) -> float:
    return 1e-3 if ctx.model.dtype == torch.float32 else 5e-2


async def _collect_into(gen, sink: list, times: list | None = None) -> str:
    async for piece in gen:
        sink.extend(piece.token_ids)
        if times is not None:
            times.extend([time.perf_counter()] * len(piece.token_ids))
    return gen.result.finish_reason if gen.result else "cancelled"


async def _wait(cond, timeout: float, what: str) -> None:
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > timeout:
            raise Deadlock(f"{what} within {timeout:.0f}s")
        await asyncio.sleep(0.002)


async def barge_in(ctx: SuiteContext, p: InterruptsPlan, repeat: int) -> BargeIn:
    m = ctx.model
    engine = m.engine(kv_tokens=4096)
    async with engine:
        start = engine_idle_state(engine)
        context = engine.block("context")
        await within(
            engine.extend(
                context,
                token_ids=m.chat(
                    "You are a museum guide. Describe the main hall of the museum to the visitors."
                ),
                name="setup",
            ),
            TIMEOUT,
            "context",
        )
        thinker = engine.block("thinker")
        await within(
            engine.extend(
                thinker,
                token_ids=m.encode("(Private notes: plan the tour route: "),
                view=[context, thinker],
                name="setup",
            ),
            TIMEOUT,
            "thinker prompt",
        )
        narr = engine.block("narration")
        await within(
            engine.extend(narr, token_ids=m.encode("Welcome! "), view=[context, narr], name="setup"),
            TIMEOUT,
            "narration prompt",
        )
        narr_prompt_len = len(narr)
        thinker_out: list[int] = []
        thinker_times: list[float] = []
        think_task = asyncio.create_task(
            _collect_into(
                engine.generate(
                    [context, thinker],
                    max_tokens=p.thinker_tokens,
                    stop_at_eos=False,
                    name="thinker",
                    priority="background",
                ),
                thinker_out,
                thinker_times,
            )
        )
        narrated: list[int] = []
        narr_task = asyncio.create_task(
            _collect_into(
                engine.generate(
                    [context, narr],
                    max_tokens=10_000,
                    stop_at_eos=False,
                    name="narrator",
                    priority="interactive",
                ),
                narrated,
            )
        )
        await _wait(lambda: len(narrated) >= p.narration_tokens_before, TIMEOUT, "narration started")
        # --- the user barges in
        t_barge = time.perf_counter()
        thinker_at_barge = len(thinker_out)
        narr_task.cancel()
        await asyncio.gather(narr_task, return_exceptions=True)
        user = engine.block("user")
        await within(
            engine.extend(
                user,
                token_ids=m.encode("\nVisitor: Sorry, where are the toilets?\nGuide:"),
                view=[context, thinker, narr, user],
                name="user",
                priority="interactive",
            ),
            TIMEOUT,
            "user input",
        )
        reply: list[int] = []
        reply_times: list[float] = []
        reply_block = engine.block("reply")
        await within(
            engine.extend(
                reply_block,
                token_ids=m.encode(" "),
                view=[context, thinker, narr, user, reply_block],
                name="reply",
                priority="interactive",
            ),
            TIMEOUT,
            "reply prompt",
        )
        await within(
            _collect_into(
                engine.generate(
                    [context, thinker, narr, user, reply_block],
                    max_tokens=p.reply_tokens,
                    stop_at_eos=False,
                    name="reply",
                    priority="interactive",
                ),
                reply,
                reply_times,
            ),
            TIMEOUT,
            "reply",
        )
        reason = await within(think_task, TIMEOUT, "thinker")
        written = narr.tokens[narr_prompt_len:]
        view = [context, thinker, narr, user, reply_block]
        # the user and reply blocks were written while the thinker still grew: check the views whose
        # blocks were written under themselves
        check = _logit_check(ctx, engine, [[context, thinker], [context, narr]], m.encode(" the")[0])
        after_barge = [t for t in thinker_times if t > t_barge]
        for b in view:
            engine.release(b)
        await asyncio.sleep(0)
        end = engine_idle_state(engine)
    return BargeIn(
        reaction_s=reply_times[0] - t_barge if reply_times else float("nan"),
        thinker_tokens_before=thinker_at_barge,
        thinker_tokens_after=len(after_barge),
        thinker_finish=reason,
        delivered_is_prefix=written[: len(narrated)] == narrated,
        undelivered=len(written) - len(narrated),
        narrated_tokens=len(narrated),
        logits=check,
        memory_returned=end == start,
        repeat=repeat,
    )


async def input_mid_reasoning(ctx: SuiteContext, p: InterruptsPlan, repeat: int) -> InputMidReasoning:
    m = ctx.model
    engine = m.engine(kv_tokens=4096)
    async with engine:
        start = engine_idle_state(engine)
        problem = engine.block("problem")
        await within(
            engine.extend(
                problem,
                token_ids=m.chat(
                    "A train leaves at 9:00 and travels for some hours. When does it arrive? Think step by "
                    "step."
                ),
                name="setup",
            ),
            TIMEOUT,
            "problem",
        )
        think = engine.block("reasoning")
        await within(
            engine.extend(think, token_ids=m.encode("Let me think."), view=[problem, think], name="setup"),
            TIMEOUT,
            "reasoning prompt",
        )
        first: list[int] = []
        gen = engine.generate(
            [problem, think], max_tokens=p.thinker_tokens, stop_at_eos=False, name="thinker"
        )
        task = asyncio.create_task(_collect_into(gen, first))
        await _wait(lambda: len(first) >= p.resume_at, TIMEOUT, "reasoning started")
        supplement = m.encode(" (New information: the journey takes 3 hours.) ")
        t_input = time.perf_counter()
        try:
            await within(
                engine.extend(think, token_ids=supplement, view=[problem, think], name="input"),
                5.0,
                "append to a busy block",
            )
            busy = "accepted"
        except BlockBusyError:
            busy = "BlockBusyError"
        t_refused = time.perf_counter() - t_input
        gen.cancel()
        await within(task, TIMEOUT, "cancelled reasoning")
        before_supplement = len(think)
        kept = think.tokens[-len(first) :] == first if first else True
        await within(
            engine.extend(
                think, token_ids=supplement, view=[problem, think], name="input", priority="interactive"
            ),
            TIMEOUT,
            "supplement",
        )
        second: list[int] = []
        times: list[float] = []
        await within(
            _collect_into(
                engine.generate(
                    [problem, think],
                    max_tokens=p.reply_tokens,
                    stop_at_eos=False,
                    name="thinker",
                    priority="interactive",
                ),
                second,
                times,
            ),
            TIMEOUT,
            "resumed reasoning",
        )
        layout_ok = think.tokens[before_supplement : before_supplement + len(supplement)] == supplement
        check = _logit_check(ctx, engine, [[problem, think]], m.encode(" So")[0])
        for b in (problem, think):
            engine.release(b)
        await asyncio.sleep(0)
        end = engine_idle_state(engine)
    return InputMidReasoning(
        reaction_s=times[0] - t_input if times else float("nan"),
        direct_append=busy,
        refusal_s=t_refused,
        tokens_before_input=len(first),
        tokens_after_input=len(second),
        generated_tokens_kept=kept,
        supplement_in_place=layout_ok,
        logits=check,
        memory_returned=end == start,
        repeat=repeat,
    )


async def cancel_resume(ctx: SuiteContext, p: InterruptsPlan, repeat: int) -> CancelResume:
    m = ctx.model
    prompt = m.chat("List three facts about the moon.")
    total, at = p.resume_total, p.resume_at
    # uninterrupted reference
    engine = m.engine(kv_tokens=4096)
    async with engine:
        ref_block = engine.block("reference")
        await within(engine.extend(ref_block, token_ids=prompt, name="setup"), TIMEOUT, "prompt")
        ref = await within(
            engine.generate(ref_block, max_tokens=total, stop_at_eos=False).collect(), TIMEOUT, "reference"
        )
        engine.release(ref_block)
    engine = m.engine(kv_tokens=4096)
    async with engine:
        start = engine_idle_state(engine)
        block = engine.block("thinker")
        await within(engine.extend(block, token_ids=prompt, name="setup"), TIMEOUT, "prompt")
        got: list[int] = []
        task = asyncio.create_task(
            _collect_into(engine.generate(block, max_tokens=total, stop_at_eos=False, name="thinker"), got)
        )
        await _wait(lambda: len(got) >= at, TIMEOUT, "thinker started")
        t_cancel = time.perf_counter()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        cancel_s = time.perf_counter() - t_cancel
        written = len(block) - len(prompt)
        delivered_is_prefix = block.tokens[len(prompt) : len(prompt) + len(got)] == got
        # something else runs meanwhile
        other = engine.block("other")
        await within(engine.extend(other, token_ids=m.chat("Say hello."), name="other"), TIMEOUT, "other")
        await within(
            engine.generate(other, max_tokens=4, stop_at_eos=False, name="other").collect(), TIMEOUT, "other"
        )
        engine.release(other)
        t_resume = time.perf_counter()
        times: list[float] = []
        rest: list[int] = []
        await within(
            _collect_into(
                engine.generate(block, max_tokens=total - written, stop_at_eos=False, name="thinker"),
                rest,
                times,
            ),
            TIMEOUT,
            "resume",
        )
        resumed = block.tokens[len(prompt) :]
        check = _logit_check(ctx, engine, [[block]], m.encode(" and")[0])
        engine.release(block)
        await asyncio.sleep(0)
        end = engine_idle_state(engine)
    same = resumed == ref.token_ids
    agree = sum(a == b for a, b in zip(resumed, ref.token_ids))
    return CancelResume(
        reaction_s=times[0] - t_resume if times else float("nan"),
        cancel_s=cancel_s,
        tokens_at_cancel=written,
        delivered_at_cancel=len(got),
        delivered_is_prefix=delivered_is_prefix,
        undelivered=written - len(got),
        resumed_equals_uninterrupted=same,
        agreeing_tokens=f"{agree}/{len(ref.token_ids)}",
        logits=check,
        memory_returned=end == start,
        repeat=repeat,
    )


SCENARIOS = (barge_in, input_mid_reasoning, cancel_resume)


async def run(ctx: SuiteContext, p: InterruptsPlan) -> SuiteResult:
    res = SuiteResult(NAME, ctx.model.key, params=plan_params(p))
    deadlocks = []
    rows: list[ScenarioRow] = []
    for rep in range(p.repeats):
        for scenario in SCENARIOS:
            ctx.say(f"{scenario.__name__.replace('_', ' ')} ({rep + 1}/{p.repeats})")
            try:
                rows.append(await scenario(ctx, p, rep))
            except Deadlock as exc:
                deadlocks.append(f"{scenario.__name__}: {exc}")
    res.records = [record(r) for r in rows]
    _analyse(ctx, res, rows, deadlocks)
    return res


def _analyse(ctx: SuiteContext, res: SuiteResult, records: list[ScenarioRow], deadlocks: list[str]) -> None:
    tol = _tol(ctx)
    rows = [
        [
            r.scenario,
            r.repeat,
            fmt(r.reaction_s),
            r.progress(),
            f"{r.logits.max_abs_diff:.2e}",
            fmt(r.logits.argmax_equal),
            fmt(r.memory_returned),
            r.other(),
        ]
        for r in records
    ]
    res.tables.append(
        Table(
            "Scenarios",
            [
                "scenario",
                "run",
                "reaction s",
                "background / generation",
                "max |logit diff| vs fresh",
                "same argmax",
                "memory returned",
                "other",
            ],
            rows,
        )
    )
    res.check("no deadlock (every wait finished within its timeout)", not deadlocks, "; ".join(deadlocks))
    by: dict[str, list[ScenarioRow]] = {}
    for r in records:
        by.setdefault(r.scenario, []).append(r)
    barge = [r for r in records if isinstance(r, BargeIn)]
    mid = [r for r in records if isinstance(r, InputMidReasoning)]
    resume = [r for r in records if isinstance(r, CancelResume)]
    if barge:
        res.check(
            "barge-in: the background thinker kept generating after the interruption",
            all(r.thinker_tokens_after > 0 and r.thinker_finish != "cancelled" for r in barge),
        )
        res.check(
            "barge-in: every delivered narration token is in the narration block, in order",
            all(r.delivered_is_prefix for r in barge),
        )
    if mid:
        res.check(
            "appending to a block being written is refused at once (BlockBusyError), not a hang",
            all(r.direct_append == "BlockBusyError" and r.refusal_s < 1 for r in mid),
        )
        res.check(
            "input lands after the kept reasoning (cancel -> extend -> resume)",
            all(r.generated_tokens_kept and r.supplement_in_place for r in mid),
        )
    if resume:
        res.check(
            "cancel-and-resume: delivered tokens are exactly the start of what was written",
            all(r.delivered_is_prefix for r in resume),
        )
        res.check(
            "cancel-and-resume: resumed output equals the uninterrupted greedy output",
            all(r.resumed_equals_uninterrupted for r in resume),
            ", ".join(r.agreeing_tokens for r in resume),
        )
    cancelled: list[BargeIn | CancelResume] = [*barge, *resume]
    undelivered = sum(r.undelivered for r in cancelled)
    res.check(
        "a cancelled consumer misses at most the one step that raced with its cancellation",
        all(r.undelivered <= 1 for r in cancelled),
        f"{undelivered} token(s) over {len(cancelled)} cancellations were written but not received; "
        "they stay in the block and in Generation.result (finish_reason 'cancelled')",
    )
    worst = max((r.logits.max_abs_diff for r in records), default=float("nan"))
    res.check(
        f"context intact: next-token logits equal a fresh recomputation (max |diff| <= {tol:g})",
        bool(records) and worst <= tol and all(r.logits.argmax_equal for r in records),
        f"worst {worst:.2e}",
    )
    res.check("all memory returned after each scenario", all(r.memory_returned for r in records))
    reactions = {s: max(r.reaction_s for r in rs) for s, rs in by.items()}
    res.headline.update(
        {f"reaction_s_{s.replace(' ', '_').replace('-', '_')}": v for s, v in reactions.items()}
    )
    res.headline["worst_logit_diff"] = worst
    res.summary = (
        "reaction "
        + ", ".join(f"{s} {v:.2f} s" for s, v in reactions.items())
        + f"; max |logit diff| vs fresh {worst:.1e}; deadlocks {len(deadlocks)}"
    )
    if reactions:
        bars(
            ctx.plot_path(NAME, "reaction"),
            f"{ctx.model.key}: interruption -> first reaction (worst run)",
            list(reactions),
            [("seconds", list(reactions.values()))],
            "seconds",
        )
        res.plots.append(ctx.plot_path(NAME, "reaction").name)
    res.conditions += [
        "single interruptions at scripted points, greedy decoding, one engine per scenario, fp32 unless "
        "stated",
        "reaction time includes prefilling the new input (a few to ~20 tokens) and the first decode step",
        "'context intact' compares live views with a recomputation as one sequence on a new engine, for "
        "views "
        "whose blocks were each written under that view (blocks written while an earlier block still grew "
        "keep, "
        "by design, what they saw then)",
    ]
