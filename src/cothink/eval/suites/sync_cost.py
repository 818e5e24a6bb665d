"""Suite 1: what it costs a foreground coroutine to see a background coroutine's progress.

A thinker generates into its own block after a long context; a reporter periodically asks (a probe)
whether the thinker has got somewhere. cothink: the probe reads the view [context, thinker] as it is
(shared memory) and processes only its question. Text-passing baseline (what a turn-based stack has
to do): copy the whole history as text into a fresh block, prefill it, then ask; and the same with the
server's prefix cache (`cothink.server.prefix_cache.PrefixCache`), the strongest form a text-passing
stack deploys: the history starts from the longest cached prefix of an earlier sync and only the rest is
prefilled. All run in the same engine on the same weights, while the thinker keeps generating, at
increasing context lengths.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from cothink.eval.common import (
    LinearFit,
    SuiteContext,
    SuiteResult,
    Table,
    fmt,
    linear_fit,
    plan_params,
    within,
)
from cothink.eval.plots import lines
from cothink.eval.workload import document_tokens
from cothink.scheduler.accounting import CoroutineStats
from cothink.server.prefix_cache import PrefixCache

NAME = "sync-cost"
TITLE = "Communication cost per sync vs context length"
QUESTION = (
    "When a background coroutine reasons and a foreground coroutine periodically reports on it, what does "
    "one sync (the foreground seeing the background's progress) cost, and does that cost grow with the "
    "context (re-encoding) or stay flat (incremental sharing)?"
)
METHOD = (
    "A thinker generates (greedy) into its block after a plant-log context of L tokens. While it runs, the "
    "reporter syncs: **shared** (cothink): one probe over the view [context, thinker] with the reporter's "
    "question prefilled in a scratch block; **text-passing** (baseline): a fresh block is prefilled with the "
    "whole history as tokens (context + thinker's text so far), then the same question is asked; "
    "**text-passing + prefix cache** (baseline as a server deploys it): the same, but the history starts "
    "from a fork of the longest prefix cached by an earlier sync (the server's prefix cache) and only the "
    "rest is prefilled. All syncs read the same thinker snapshot, so their answers must agree to float "
    "tolerance. Tokens processed = "
    "tokens run through the model for the sync (engine accounting); seconds = wall time of the sync. "
    "Lines are fitted to tokens/sync and seconds/sync against L."
)

CACHED = "text-passing + prefix cache"
QUICK_CONTEXTS = [256, 512, 1024, 2048]
FULL_CONTEXTS = [256, 512, 1024, 2048, 4096, 8192, 16384]
TIMEOUT = 1800.0


@dataclass(frozen=True, slots=True)
class SyncCostPlan:
    """The suite's knobs (written verbatim into config.json and the suite's params)."""

    contexts: tuple[int, ...]  # context lengths the thinker grows through
    syncs_per_context: int  # syncs measured at each length
    thinker_tokens_between_syncs: int


@dataclass(frozen=True, slots=True)
class SyncRow:
    """One sync: a row of raw/sync-cost-<model>.csv (a shared sync and its text-passing twin read the
    same thinker snapshot)."""

    method: str  # "shared" (cothink), "text-passing" or "text-passing + prefix cache" (the baselines)
    context: int  # L: tokens of the context block
    sync: int  # index of the sync at this context length
    view_tokens: int  # tokens the sync's view holds: L + the thinker's tokens it read
    seconds: float  # wall time of the sync
    tokens_processed: int  # tokens run through the model for the sync (engine accounting)
    tokens_read: int  # tokens attended over (engine accounting)
    forward_passes: int  # engine steps the sync took part in
    p_yes: float  # the probe's P(" yes")
    thinker_len: int  # tokens of the thinker's block the sync read
    abs_diff_p: float  # |P(yes) shared - P(yes) of this baseline| for this snapshot (0 for shared)
    cache_hit_tokens: int = 0  # history tokens the prefix cache supplied (prefix-cache baseline only)


@dataclass(frozen=True, slots=True)
class ThinkerRow:
    """The thinker over one context length: a row of raw/sync-cost-<model>.csv."""

    method: str  # always "thinker"
    context: int  # L: tokens of the context block
    thinker_tokens: int  # tokens the thinker generated while the syncs at this length ran


def plan(quick: bool, duration: float | None = None) -> SyncCostPlan:
    return SyncCostPlan(
        contexts=tuple(QUICK_CONTEXTS if quick else FULL_CONTEXTS),
        syncs_per_context=1 if quick else 3,
        thinker_tokens_between_syncs=2,
    )


def _estimate_raw(p: SyncCostPlan, speed) -> float:
    total = 0.0
    for L in p.contexts:
        # context growth + per sync a re-encode of ~L tokens (at lower speed for long contexts)
        slow = 1 + L / 4096
        total += (L / 2) / speed.prefill_tps * slow + p.syncs_per_context * (
            L / speed.prefill_tps * slow + 6 * speed.step_s * 1.4
        )
    return total


def estimate_s(p: SyncCostPlan, speed) -> float:
    """Seconds, from the calibrated speed; the factor was fitted to measured quick runs on a 2-core CPU."""
    return 1.9 * _estimate_raw(p, speed)


async def _wait_length(block, n: int, task: asyncio.Task, timeout: float = 300.0) -> None:
    t0 = time.perf_counter()
    while len(block) < n:
        if task.done():
            return
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"block {block.name} did not reach {n} tokens")
        await asyncio.sleep(0.005)


async def run(ctx: SuiteContext, p: SyncCostPlan) -> SuiteResult:
    m = ctx.model
    res = SuiteResult(NAME, m.key, params=plan_params(p))
    contexts = p.contexts
    lmax = max(contexts)
    # the prefix cache keeps forks of earlier histories: they share their common prefix's pages
    engine = m.engine(kv_tokens=3 * lmax + 4096, max_context=lmax + 1024)
    cache = PrefixCache(
        engine,
        max_pages=-(-(lmax + 1024) // engine.runner.store.page_size) * 2,
        page_size=engine.runner.store.page_size,
    )
    doc = document_tokens(m, ctx.seed, lmax)
    thinker_prompt = m.encode(
        "\n\nThinker: I will go through the records one by one and find the highest reading. "
    )
    question = m.encode("\n\nReporter: has the thinker already named the highest reading? Answer:")
    choices = (" yes", " no")
    tol = 2e-3 if str(m.dtype) == "torch.float32" else 5e-2
    rows: list[SyncRow | ThinkerRow] = []  # in the order they are written
    async with engine:
        ctx_block = engine.block("context")
        for L in contexts:
            ctx.say(f"context {L} tokens")
            await within(
                engine.extend(ctx_block, token_ids=doc[len(ctx_block) : L], name="setup"),
                TIMEOUT,
                "context prefill",
            )
            bg = engine.block("thinker")
            await within(
                engine.extend(bg, token_ids=thinker_prompt, view=[ctx_block, bg], name="setup"),
                TIMEOUT,
                "thinker prompt",
            )
            gen = engine.generate(
                [ctx_block, bg],
                max_tokens=1_000_000,
                stop_at_eos=False,
                name=f"thinker-{L}",
                priority="background",
            )
            produced: list[int] = []

            async def think(gen=gen, produced=produced) -> None:
                async for piece in gen:
                    produced.extend(piece.token_ids)

            task = asyncio.create_task(think())
            await _wait_length(bg, len(thinker_prompt) + 2, task)
            for s in range(p.syncs_per_context):
                name = f"sync-shared-{L}-{s}"
                t0 = time.perf_counter()
                probs_shared = await within(
                    engine.probe([ctx_block, bg], question, choices, name=name), TIMEOUT, "shared sync"
                )
                dt_shared = time.perf_counter() - t0
                st_shared = engine.stats[name]
                # The thinker keeps writing while the probe waits for its step: the probe read the
                # thinker's block as far as its step's start, which its own accounting tells.
                n = st_shared.tokens_read - len(ctx_block) - st_shared.tokens_written
                snapshot = list(ctx_block.tokens) + list(bg.tokens[:n])
                name = f"sync-text-{L}-{s}"
                t0 = time.perf_counter()
                copy = engine.block("text-copy")
                await within(
                    engine.extend(copy, token_ids=snapshot, name=name, priority="interactive"),
                    TIMEOUT,
                    "text-passing prefill",
                )
                probs_text = await within(
                    engine.probe([copy], question, choices, name=name), TIMEOUT, "text-passing sync"
                )
                dt_text = time.perf_counter() - t0
                engine.release(copy)
                st_text = engine.stats[name]
                diff = abs(probs_shared[" yes"] - probs_text[" yes"])
                name = f"sync-cached-{L}-{s}"
                t0 = time.perf_counter()
                cached, hit = cache.start("eval", snapshot, name)
                await within(
                    engine.extend(cached, token_ids=snapshot[hit:], name=name, priority="interactive"),
                    TIMEOUT,
                    "prefix-cached text-passing prefill",
                )
                probs_cached = await within(
                    engine.probe([cached], question, choices, name=name), TIMEOUT, "prefix-cached sync"
                )
                dt_cached = time.perf_counter() - t0
                cache.insert("eval", snapshot, cached)
                engine.release(cached)
                diff_cached = abs(probs_shared[" yes"] - probs_cached[" yes"])
                rows += [
                    _sync_row(
                        "shared", L, s, n, dt_shared, st_shared, probs_shared[" yes"], max(diff, diff_cached)
                    ),
                    _sync_row("text-passing", L, s, n, dt_text, st_text, probs_text[" yes"], diff),
                    dataclasses.replace(
                        _sync_row(
                            CACHED, L, s, n, dt_cached, engine.stats[name], probs_cached[" yes"], diff_cached
                        ),
                        cache_hit_tokens=hit,
                    ),
                ]
                await _wait_length(bg, len(bg) + p.thinker_tokens_between_syncs, task)
            gen.cancel()
            await within(task, 60, "thinker cancel")
            rows.append(ThinkerRow(method="thinker", context=L, thinker_tokens=len(produced)))
            engine.release(bg)
        engine.release(ctx_block)
        cache.clear()
    res.records = [asdict(r) for r in rows]
    _analyse(ctx, res, rows, contexts, tol)
    return res


def _sync_row(
    method: str,
    context: int,
    sync: int,
    thinker_len: int,
    seconds: float,
    stats: CoroutineStats,
    p_yes: float,
    diff: float,
) -> SyncRow:
    """One sync's row, from the engine's accounting of the sync's coroutine (`engine.stats[name]`)."""
    return SyncRow(
        method=method,
        context=context,
        sync=sync,
        view_tokens=context + thinker_len,
        seconds=seconds,
        tokens_processed=stats.tokens_written,
        tokens_read=stats.tokens_read,
        forward_passes=stats.forward_passes,
        p_yes=p_yes,
        thinker_len=thinker_len,
        abs_diff_p=diff,
    )


METHODS = ("shared", "text-passing", CACHED)
Fits = dict[str, tuple[LinearFit, LinearFit]]  # method -> (tokens fit, seconds fit)
Means = dict[tuple[str, int], tuple[float, float, float]]  # (method, L) -> mean tokens, seconds, passes


def _analyse(
    ctx: SuiteContext,
    res: SuiteResult,
    records: list[SyncRow | ThinkerRow],
    contexts: Sequence[int],
    tol: float,
) -> None:
    syncs = [r for r in records if isinstance(r, SyncRow)]
    thinkers = [r for r in records if isinstance(r, ThinkerRow)]
    fits, per = _fits_and_means(syncs, contexts)
    res.tables += [_per_sync_table(per, thinkers, contexts), _fits_table(fits)]
    lmax = max(contexts)
    _headline_and_checks(res, syncs, thinkers, fits, per, lmax, tol)
    _plot(ctx, res, per, contexts)
    _conditions(ctx, res, syncs, contexts)


def _fits_and_means(syncs: list[SyncRow], contexts: Sequence[int]) -> tuple[Fits, Means]:
    """Per method: linear fits of a sync's tokens (against what its view held: L and the thinker's
    tokens by then, which vary with where the sync lands between steps, so a baseline that re-encodes
    its view has slope 1 exactly) and seconds (against L); and per method and L the means."""
    fits, per = {}, {}
    for method in METHODS:
        recs = [r for r in syncs if r.method == method]
        fits[method] = (
            linear_fit([r.view_tokens for r in recs], [r.tokens_processed for r in recs]),
            linear_fit([r.context for r in recs], [r.seconds for r in recs]),
        )
        for L in contexts:
            rs = [r for r in recs if r.context == L]
            per[(method, L)] = (
                sum(r.tokens_processed for r in rs) / len(rs),
                sum(r.seconds for r in rs) / len(rs),
                sum(r.forward_passes for r in rs) / len(rs),
            )
    return fits, per


def _per_sync_table(per: Means, thinkers: list[ThinkerRow], contexts: Sequence[int]) -> Table:
    rows = []
    for L in contexts:
        ts, ss, fs = per[("shared", L)]
        tt, st, ft = per[("text-passing", L)]
        tc, sc, _ = per[(CACHED, L)]
        thinker = [r.thinker_tokens for r in thinkers if r.context == L]
        rows.append(
            [
                L,
                fmt(ts),
                fmt(ss),
                fmt(fs),
                fmt(tt),
                fmt(st),
                fmt(ft),
                fmt(st / ss if ss else float("nan"), 2),
                fmt(tc),
                fmt(sc),
                fmt(sc / ss if ss else float("nan"), 2),
                thinker[0] if thinker else "-",
            ]
        )
    return Table(
        "Per sync, mean over syncs at each context length",
        [
            "context L",
            "shared tokens",
            "shared s",
            "shared passes",
            "text tokens",
            "text s",
            "text passes",
            "time ratio text/shared",
            "cached text tokens",
            "cached text s",
            "time ratio cached/shared",
            "thinker tokens during phase",
        ],
        rows,
    )


def _fits_table(fits: Fits) -> Table:
    names = {"shared": "shared (cothink)", "text-passing": "text-passing", CACHED: CACHED}
    rows = []
    for m in METHODS:
        ft, fs = fits[m]
        rows.append([names[m], fmt(ft.slope, 4), fmt(ft.intercept), fmt(fs.slope * 1000, 4),
                     fmt(fs.intercept, 4), fmt(fs.r2, 3)])
    return Table(
        "Linear fits per sync: tokens against the view's tokens, seconds against context length L",
        [
            "method",
            "tokens/sync slope (per view token)",
            "tokens/sync intercept",
            "s/sync slope (per 1k ctx)",
            "s/sync intercept",
            "R^2 (s)",
        ],
        rows,
    )


def _headline_and_checks(
    res: SuiteResult, syncs: list[SyncRow], thinkers: list[ThinkerRow], fits: Fits, per: Means, lmax: int,
    tol: float,
) -> None:
    (fts, fss), (ftt, fst) = fits["shared"], fits["text-passing"]
    ratio_tokens = per[("text-passing", lmax)][0] / per[("shared", lmax)][0]
    ratio_time = per[("text-passing", lmax)][1] / per[("shared", lmax)][1]
    res.headline.update(
        {
            "shared_tokens_per_sync_slope": fts.slope,
            "text_tokens_per_sync_slope": ftt.slope,
            "shared_s_per_sync_slope_per_1k": fss.slope * 1000,
            "text_s_per_sync_slope_per_1k": fst.slope * 1000,
            "max_context": lmax,
            "tokens_ratio_at_max": ratio_tokens,
            "time_ratio_at_max": ratio_time,
            "shared_s_per_sync_at_max": per[("shared", lmax)][1],
            "text_s_per_sync_at_max": per[("text-passing", lmax)][1],
            "cached_tokens_per_sync_at_max": per[(CACHED, lmax)][0],
            "cached_s_per_sync_at_max": per[(CACHED, lmax)][1],
        }
    )
    res.summary = (
        f"tokens per sync: shared {per[('shared', lmax)][0]:.0f} at every L (slope {fts.slope:.4f}), "
        "text-passing "
        f"slope {ftt.slope:.3f} per view token; at L={lmax}: {per[('shared', lmax)][1]:.2f} s vs "
        f"{per[('text-passing', lmax)][1]:.2f} s per sync ({ratio_time:.0f}x); with the prefix cache "
        f"{per[(CACHED, lmax)][0]:.0f} tokens, {per[(CACHED, lmax)][1]:.2f} s"
    )
    diffs = [r.abs_diff_p for r in syncs if r.method == "shared"]
    res.check(
        "shared sync processes a constant number of tokens (slope < 0.01 per view token)",
        abs(fts.slope) < 0.01,
        f"slope {fts.slope:.4f}, {per[('shared', lmax)][0]:.0f} tokens at L={lmax}",
    )
    res.check(
        "text-passing baseline really re-encodes (tokens/sync slope >= 0.9)",
        ftt.slope >= 0.9,
        f"slope {ftt.slope:.3f}",
    )
    res.check(
        f"all syncs give the same answer (|p(yes) difference| <= {tol:g})",
        max(diffs) <= tol,
        f"max difference {max(diffs):.2e}",
    )
    cached = [r for r in syncs if r.method == CACHED]
    res.check(
        "the prefix-cache baseline reuses earlier histories (every sync after the first starts from a "
        "cached prefix)",
        all(r.cache_hit_tokens > 0 for r in cached[1:]),
        f"cached prefix tokens per sync: {[r.cache_hit_tokens for r in cached]}",
    )
    shared_by_sync = {(r.context, r.sync): r.tokens_processed for r in syncs if r.method == "shared"}
    res.check(
        "the shared sync processes fewer tokens than text passing even with the prefix cache, at every sync",
        all(shared_by_sync[(r.context, r.sync)] < r.tokens_processed for r in cached),
        f"at L={lmax}: {per[('shared', lmax)][0]:.0f} vs {per[(CACHED, lmax)][0]:.0f} tokens per sync",
    )
    res.check(
        "shared sync is cheaper in time than re-encoding at the largest context",
        ratio_time > 1,
        f"text/shared time ratio {ratio_time:.1f} at L={lmax}",
        timing=True,
    )
    res.info(
        "time against the prefix-cache baseline at the largest context",
        f"cached/shared time ratio {per[(CACHED, lmax)][1] / per[('shared', lmax)][1]:.1f} at L={lmax}",
    )
    res.check("the thinker kept generating during the syncs", all(r.thinker_tokens > 0 for r in thinkers))


def _plot(ctx: SuiteContext, res: SuiteResult, per: Means, contexts: Sequence[int]) -> None:
    labels = {"shared": "shared (cothink)", "text-passing": "text-passing (re-encode)", CACHED: CACHED}
    lines(
        ctx.plot_path(NAME, "curve"),
        f"{ctx.model.key}: cost of one sync vs context",
        "context length L (tokens)",
        [
            (title, [(labels[m], contexts, [per[(m, L)][i] for L in contexts]) for m in METHODS])
            for i, title in enumerate(("tokens processed per sync", "seconds per sync"))
        ],
    )
    res.plots.append(ctx.plot_path(NAME, "curve").name)


def _conditions(ctx: SuiteContext, res: SuiteResult, syncs: list[SyncRow], contexts: Sequence[int]) -> None:
    lmax = max(contexts)
    trained = ctx.model.info.get("trained_context")
    res.conditions += [
        f"contexts {min(contexts)}..{lmax} tokens; {res.params['syncs_per_context']} sync(s) per context "
        "length; "
        "one thinker decoding concurrently; the sync is a one-token-answer probe "
        f"({len(ctx.model.encode(' x'))}-token choices, question of "
        f"{syncs[0].tokens_processed if syncs else '?'} tokens)",
        "text-passing baselines prefilled in the same engine (chunks of 128 tokens, interactive priority): "
        "re-encoding the whole history, and with the server's prefix cache (one account, every earlier "
        "history cached), which prefills only what follows the longest cached prefix: the context grown "
        "since the last length and the thinker's text",
        "the shared sync still *reads* the whole view (attention over L keys per query token): its time "
        "grows "
        "slowly with L, its processed tokens do not",
    ]
    if trained and lmax > trained:
        res.conditions.append(
            f"contexts beyond {trained} tokens exceed the model's trained context: costs hold, "
            "answers there are meaningless"
        )
    if ctx.quick and lmax < 16384:
        res.notes.append(f"quick mode stops at L={lmax}; the full run goes to 16384")
