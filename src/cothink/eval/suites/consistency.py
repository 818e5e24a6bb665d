"""Suite 4: output consistency when a narrator interleaves with a thinker.

The thinker solves multi-step arithmetic problems (greedy). Run 1: alone. Run 2: a narrator
periodically snapshots the thinker's block (a fork: copy-on-write, no re-encode) and says in a few
tokens what has been computed so far, concurrently, in the same engine. The narrator only reads, so
the thinker's tokens must be identical in both runs. Each narration must depend only on the prefix
it read: it is recomputed on a fresh engine from exactly that prefix and must match token for token.
Every number a narration mentions is classified against the thinker's text.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

from cothink.eval.common import SuiteContext, SuiteResult, Table, fmt, numbers_in, plan_params, within
from cothink.eval.plots import bars
from cothink.eval.workload import Problem, UserProblem, load_problems, problems

NAME = "consistency"
TITLE = "Output consistency under interleaving"
QUESTION = (
    "When a narrator coroutine reports on a thinker while it reasons, does the interleaving change the "
    "thinker's result or break its logic, and does the narration ever report a step the thinker has not "
    "reached?"
)
METHOD = (
    "Deterministic problems `((a+b)*c)-d`, solved step by step by a greedy thinker (chat prompt). The same "
    "problems are solved alone and with a narrator interleaving: every K thinker tokens the narrator forks "
    "the thinker's block (a snapshot of its prefix, shared pages), appends its own question and generates a "
    "short report, concurrently with the thinker. Checks: thinker tokens identical with and without the "
    "narrator; each narration equal to a recomputation from its prefix on a fresh engine (it saw nothing "
    "beyond the prefix); numbers in narrations classified as from the problem, reached (in the thinker's "
    "text up to the snapshot), ahead (only in the thinker's later text) or elsewhere. Accuracy = last number "
    "of the thinker's text equals the true answer."
)

TIMEOUT = 600.0
NARRATOR_QUESTION = "Which intermediate result has been computed so far? Reply with the number."


@dataclass(frozen=True, slots=True)
class ConsistencyPlan:
    """The suite's knobs (written verbatim into config.json and the suite's params)."""

    problems: int
    thinker_tokens: int
    narrate_every: int  # thinker tokens between narrations
    narrations: int
    narration_tokens: int
    problems_file: str | None = None  # a user problem set (--problems, JSON Lines); None: generated


@dataclass(frozen=True, slots=True)
class Narration:
    """What one narration read and wrote, as the narrator saw it (checked afterwards)."""

    prefix_len: int  # tokens of the thinker's block in the snapshot (the prompt included)
    prefix_tokens: list[int]  # the snapshot's tokens
    tokens: list[int]  # the narration's tokens
    text: str
    seconds: float  # the narration's prefill and generation
    thinker_len_after: int  # tokens of the thinker's block when the narration was done (prompt included)


@dataclass(frozen=True, slots=True)
class Solved:
    """One thinker run on one problem, with or without a narrator."""

    out: list[int]  # the tokens the thinker generated
    tokens: list[int]  # its whole block at the end (prompt, reasoning)
    narrations: list[Narration]
    question: list[int]  # the narrator's question tokens


@dataclass(frozen=True, slots=True)
class NarrationRow:
    """One narration, checked: an entry of its problem's `narrations` column."""

    read_prefix_tokens: int  # thinker tokens (after the prompt) the narration read
    text: str
    replay_identical: bool  # equal to a greedy recomputation from its prefix on a fresh engine
    replay_margin: float | None  # where not: the replay's logit lead over the narration's token there
    numbers: list[int]  # the numbers the narration mentions
    classes: list[str]  # per number: problem, reached, ahead or elsewhere
    seconds: float  # the narration's prefill and generation
    thinker_len_after: int  # thinker tokens (after the prompt) when the narration was done


@dataclass(frozen=True, slots=True)
class ProblemRow:
    """One problem, solved alone and with a narrator: a row of raw/consistency-<model>.csv."""

    problem: str  # the expression, ((a+b)*c)-d, or the start of a user problem's question
    answer: int | str
    solo_text: str  # the thinker's text alone
    narrated_text: str  # and with the narrator
    identical_tokens: bool  # the thinker wrote the same tokens in both runs
    # where not: at their first difference, the logit lead of the run-alone's token over the other's
    # in a fresh recomputation from the common prefix (a near-tie when small)
    difference_margin: float | None
    solo_tokens: int
    narrated_run_tokens: int
    final_number: int | None  # the last number of the narrated run's text
    correct: bool  # the answer: final_number equals it (a number), the text contains it (a user's text)
    solo_correct: bool  # the same for the run alone
    mentions_steps: list[bool]  # per intermediate result: does the narrated run's text contain it
    narrations: list[NarrationRow]


def plan(quick: bool, duration: float | None = None) -> ConsistencyPlan:
    if quick:
        return ConsistencyPlan(
            problems=3, thinker_tokens=64, narrate_every=12, narrations=3, narration_tokens=4
        )
    return ConsistencyPlan(
        problems=12, thinker_tokens=128, narrate_every=12, narrations=6, narration_tokens=8
    )


def _estimate_raw(p: ConsistencyPlan, speed) -> float:
    batch = 1 + 0.35 * (p.problems - 1)
    run = p.thinker_tokens * speed.step_s * batch
    replays = p.problems * p.narrations * (p.narration_tokens * speed.step_s + 120 / speed.prefill_tps)
    return 2.3 * run + replays


def estimate_s(p: ConsistencyPlan, speed) -> float:
    """Seconds, from the calibrated speed; the factor was fitted to measured quick runs on a 2-core CPU."""
    return 1.25 * _estimate_raw(p, speed)


async def _solve(
    ctx: SuiteContext, engine, prompt: list[int], p: ConsistencyPlan, narrate: bool, tag: str
) -> Solved:
    m = ctx.model
    block = engine.block(f"thinker-{tag}")
    await within(engine.extend(block, token_ids=prompt, name=f"thinker-{tag}"), TIMEOUT, "thinker prompt")
    out: list[int] = []
    gen = engine.generate(block, max_tokens=p.thinker_tokens, name=f"thinker-{tag}", priority="background")
    narrations: list[Narration] = []
    question = m.encode(
        "<|im_end|>\n<|im_start|>user\n" + NARRATOR_QUESTION + "<|im_end|>\n<|im_start|>assistant\n"
        "So far the result is"
    )

    async def narrator() -> None:
        next_at = p.narrate_every
        while len(narrations) < p.narrations and not think_task.done():
            if len(out) < next_at:
                await asyncio.sleep(0.002)
                continue
            snap = engine.fork(block, f"snapshot-{tag}-{len(narrations)}")
            prefix = len(snap)
            narr = engine.block(f"narration-{tag}-{len(narrations)}")
            t0 = time.perf_counter()
            try:
                await engine.extend(
                    narr, token_ids=question, view=[snap, narr], name="narrator", priority="interactive"
                )
                res = await engine.generate(
                    [snap, narr],
                    max_tokens=p.narration_tokens,
                    stop_at_eos=False,
                    name="narrator",
                    priority="interactive",
                ).collect()
            finally:
                prefix_tokens = list(snap.tokens)
                engine.release(narr)
                engine.release(snap)
            narrations.append(
                Narration(
                    prefix_len=prefix,
                    prefix_tokens=prefix_tokens,
                    tokens=res.token_ids,
                    text=res.text,
                    seconds=time.perf_counter() - t0,
                    thinker_len_after=len(block),
                )
            )
            next_at = len(out) + p.narrate_every

    async def think() -> None:
        async for piece in gen:
            out.extend(piece.token_ids)

    think_task = asyncio.create_task(think())
    tasks = [think_task] + ([asyncio.create_task(narrator())] if narrate else [])
    await within(asyncio.gather(*tasks), TIMEOUT, "thinker and narrator")
    tokens = list(block.tokens)
    engine.release(block)
    return Solved(out, tokens, narrations, question)


def _replay_narration(ctx: SuiteContext, prefix: list[int], question: list[int], n: int) -> list[int]:
    """Greedy continuation of prefix + question on a fresh engine (one block, no sharing)."""
    runner = ctx.model.new_runner(kv_tokens=len(prefix) + len(question) + n + 64)
    block = runner.new_block("replay")
    logits = runner.extend(block, prefix + question, logits="last")
    out = []
    for i in range(n):
        tok = int(logits[-1].argmax())
        out.append(tok)
        if i + 1 < n:
            logits = runner.extend(block, [tok], logits="last")
    return out


def first_difference_margin(ctx: SuiteContext, prefix: list[int], a: list[int], b: list[int]) -> float | None:
    """None when token lists a and b (greedy continuations of `prefix`) are equal; else, at their first
    difference j, logit[a_j] - logit[b_j] after prefix + a[:j] on a fresh engine (one block, nothing
    shared): how close the two runs' choices were. A lead of a fraction of a logit is a near-tie that
    the rounding of another batch composition can flip; a large one is not."""
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if j is None:
        if len(a) == len(b):
            return None
        j = min(len(a), len(b))  # one run stopped (end of turn) where the other went on
    context = prefix + a[:j]
    runner = ctx.model.new_runner(kv_tokens=len(context) + 64)
    logits = runner.extend(runner.new_block("difference"), context, logits="last")[-1].float()
    stop = max((float(logits[t]) for t in runner.config.eos_token_ids), default=float("nan"))  # a run ended

    def lead(t: list[int]) -> float:
        return float(logits[t[j]]) if j < len(t) else stop

    return lead(a) - lead(b)


def _classify(number: int, problem: Problem | UserProblem, prefix_text: str, later_text: str) -> str:
    if number in problem.operands:
        return "problem"
    if number in numbers_in(prefix_text):
        return "reached"
    if number in numbers_in(later_text):
        return "ahead"
    return "elsewhere"


async def run(ctx: SuiteContext, p: ConsistencyPlan) -> SuiteResult:
    m = ctx.model
    res = SuiteResult(NAME, m.key, params=plan_params(p))
    engine = m.engine(kv_tokens=8192)
    counts = {"problem": 0, "reached": 0, "ahead": 0, "elsewhere": 0}
    probs: list[Problem] | list[UserProblem] = (
        load_problems(p.problems_file) if p.problems_file else problems(ctx.seed, p.problems)
    )
    prompts = [m.chat(prob.prompt) for prob in probs]
    async with engine:
        ctx.say(f"{len(probs)} problems without narrator")
        solos = await asyncio.gather(
            *[_solve(ctx, engine, prompt, p, False, f"{i}-solo") for i, prompt in enumerate(prompts)]
        )
        ctx.say(f"{len(probs)} problems with narrators")
        narrated = await asyncio.gather(
            *[_solve(ctx, engine, prompt, p, True, f"{i}-narrated") for i, prompt in enumerate(prompts)]
        )
        rows = [
            _check_problem(ctx, i, prob, prompt, solo, narrated_run, counts)
            for i, (prob, prompt, solo, narrated_run) in enumerate(zip(probs, prompts, solos, narrated))
        ]
    res.records = [asdict(r) for r in rows]
    _analyse(ctx, res, rows, counts)
    return res


def _check_problem(
    ctx: SuiteContext,
    i: int,
    prob: Problem | UserProblem,
    prompt: list[int],
    solo_run: Solved,
    narrated_run: Solved,
    counts: dict[str, int],
) -> ProblemRow:
    """Compare the two runs of one problem, replay each narration from its prefix and classify the
    numbers it mentions (adding them to counts)."""
    tok = ctx.model.tokenizer
    solo, inter, inter_tokens = solo_run.out, narrated_run.out, narrated_run.tokens
    text = tok.decode(inter, skip_special_tokens=True)
    solo_text = tok.decode(solo, skip_special_tokens=True)
    nums = numbers_in(text)
    checked = []
    for n in narrated_run.narrations:
        ctx.say(f"problem {i + 1}: replaying narration at {n.prefix_len} tokens")
        replay = _replay_narration(ctx, n.prefix_tokens, narrated_run.question, len(n.tokens))
        prefix_text = tok.decode(n.prefix_tokens[len(prompt) :], skip_special_tokens=True)
        later_text = tok.decode(inter_tokens[n.prefix_len :], skip_special_tokens=True)
        classes = [_classify(x, prob, prefix_text, later_text) for x in numbers_in(n.text)]
        for c in classes:
            counts[c] += 1
        checked.append(
            NarrationRow(
                read_prefix_tokens=n.prefix_len - len(prompt),
                text=n.text,
                replay_identical=replay == n.tokens,
                replay_margin=first_difference_margin(ctx, n.prefix_tokens + narrated_run.question, replay,
                                                      n.tokens),
                numbers=numbers_in(n.text),
                classes=classes,
                seconds=n.seconds,
                thinker_len_after=n.thinker_len_after - len(prompt),
            )
        )
    return ProblemRow(
        problem=prob.label,
        answer=prob.answer,
        solo_text=solo_text,
        narrated_text=text,
        identical_tokens=solo == inter,
        difference_margin=first_difference_margin(ctx, prompt, solo, inter),
        solo_tokens=len(solo),
        narrated_run_tokens=len(inter),
        final_number=nums[-1] if nums else None,
        correct=prob.is_correct(text),
        solo_correct=prob.is_correct(solo_text),
        mentions_steps=[s in nums for s in prob.steps],
        narrations=checked,
    )


def _analyse(ctx: SuiteContext, res: SuiteResult, records: list[ProblemRow], counts: dict[str, int]) -> None:
    rows = []
    for r in records:
        snippet = r.narrated_text.replace("\n", " ")
        rows.append(
            [
                r.problem,
                r.answer,
                fmt(r.final_number),
                fmt(r.solo_correct),
                fmt(r.correct),
                fmt(r.identical_tokens),
                len(r.narrations),
                snippet[:70] + ("..." if len(snippet) > 70 else ""),
            ]
        )
    res.tables.append(
        Table(
            "Problems",
            [
                "problem",
                "answer",
                "thinker's last number",
                "correct alone",
                "correct with narrator",
                "identical tokens",
                "narrations",
                "thinker text (start)",
            ],
            rows,
        )
    )
    nrows = []
    for r in records:
        for n in r.narrations:
            t = n.text.replace("\n", " ")
            nrows.append(
                [
                    r.problem,
                    n.read_prefix_tokens,
                    n.thinker_len_after,
                    fmt(n.replay_identical),
                    t[:60] + ("..." if len(t) > 60 else ""),
                    ", ".join(f"{x}:{c}" for x, c in zip(n.numbers, n.classes)) or "-",
                ]
            )
    res.tables.append(
        Table(
            "Narrations",
            [
                "problem",
                "thinker tokens read",
                "thinker tokens when done",
                "same as replay from prefix",
                "narration ('So far the result is' ...)",
                "numbers: class",
            ],
            nrows,
        )
    )
    n = len(records)
    solo_acc = sum(r.solo_correct for r in records) / n if n else float("nan")
    acc = sum(r.correct for r in records) / n if n else float("nan")
    identical = all(r.identical_tokens for r in records)
    replays = [x.replay_identical for r in records for x in r.narrations]
    res.headline.update(
        {
            "accuracy_alone": solo_acc,
            "accuracy_with_narrator": acc,
            "identical_thinker_tokens": identical,
            "narrations": len(replays),
            "narrations_equal_replay": sum(replays),
            "number_classes": dict(counts),
        }
    )
    res.summary = (
        f"thinker tokens identical with/without narrator: {sum(r.identical_tokens for r in records)}"
        f"/{n}; narrations equal to replay from their prefix: {sum(replays)}/{len(replays)}; accuracy "
        f"{solo_acc:.0%} alone, {acc:.0%} with narrator; numbers {counts}"
    )
    res.check(
        "thinker tokens identical with and without the narrator (greedy)",
        identical,
        f"{sum(r.identical_tokens for r in records)}/{n} problems",
    )
    res.check(
        "every narration equals a fresh recomputation from the prefix it read (nothing leaked from later)",
        bool(replays) and all(replays),
        f"{sum(replays)}/{len(replays)} narrations",
    )
    margins = [r.difference_margin for r in records if r.difference_margin is not None]
    margins += [x.replay_margin for r in records for x in r.narrations if x.replay_margin is not None]
    if margins:
        res.info(
            "where tokens differ: the first difference's logit margin in a fresh recomputation",
            ", ".join(f"{m:.3f}" for m in margins) + " logits (the alone / replayed token's lead over the "
            "other run's): a fraction of a logit is a near-tie that another batch's rounding can flip "
            "(docs/runtime.md: batch invariance to float tolerance); a large lead would be a leak",
        )
    res.check(
        "accuracy unchanged by the narrator",
        solo_acc == acc,
        f"alone {solo_acc:.0%}, with narrator {acc:.0%}",
    )
    res.check(
        "no narration mentions a number that only appears later in the thinker's text",
        counts["ahead"] == 0,
        f"classes: {counts}; an 'ahead' number with an identical replay can only come from the narrator "
        "computing it itself (the model), not from the runtime",
        soft=True,
    )
    bars(
        ctx.plot_path(NAME, "numbers"),
        f"{ctx.model.key}: numbers mentioned by narrations",
        list(counts),
        [("count", list(counts.values()))],
        "numbers",
    )
    res.plots.append(ctx.plot_path(NAME, "numbers").name)
    source = (
        f"{n} problems from {res.params['problems_file']} (JSON Lines, question/answer)"
        if res.params.get("problems_file")
        else f"{n} problems ((a+b)*c)-d with a, b in 2..19, c in 2..9, d in 1..30"
    )
    res.conditions += [
        f"{source}; thinker greedy, at most "
        f"{res.params['thinker_tokens']} tokens; narrator every {res.params['narrate_every']} thinker "
        "tokens, "
        f"{res.params['narration_tokens']} greedy tokens, at most {res.params['narrations']} per problem",
        "all problems run concurrently in both runs (batched); the only difference between the runs is the "
        "narrators",
        "identity of the thinker's tokens relies on batch invariance (a step's result does not depend on "
        "which "
        "other items share it) and greedy decoding; with sampling, compare distributions instead",
    ]
    if ctx.model.key == "qwen35-random":
        res.conditions.append(
            "random weights: accuracy is meaningless; identity and replay checks still hold"
        )
    else:
        res.conditions.append("SmolLM2-135M is a weak reasoner: accuracy measures the model, not the runtime")
