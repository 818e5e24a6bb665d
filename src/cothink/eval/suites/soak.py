"""Suite 5: long run. Coroutines are created, fed random input, interrupted and released in a loop.

Resident memory (psutil), KV pool usage, live blocks, running works, asyncio tasks and the engine's
per-coroutine bookkeeping are sampled over time. The suite fails if a series keeps growing over the
second half of the run (a fitted line, against a threshold) or if anything is left at the end (blocks,
pages, works, tasks).
"""

from __future__ import annotations

import asyncio
import gc
import random
import time
from collections import Counter

import psutil

from cothink.eval.common import (
    SuiteContext,
    SuiteResult,
    Table,
    detect_growth,
    engine_idle_state,
    fmt,
    within,
)
from cothink.eval.plots import lines
from cothink.eval.workload import document_tokens, random_token_ids

NAME = "soak"
TITLE = "Long-run stability: memory, blocks and tasks"
QUESTION = (
    "Over a long run with constant churn (coroutines created, fed, interrupted, released), does memory stay "
    "flat, and are blocks, pages, works and tasks all returned?"
)
METHOD = (
    "C sessions run at a time, for the given duration; each: a block reading a shared context, random input "
    "(random token ids), sometimes a fork, a sampled generation of a few tokens, sometimes a probe; 40% are "
    "interrupted (their task cancelled at a random moment); every session releases its blocks in `finally`. "
    "Sampled every 0.25 s: resident set size (RSS), used KV pages, live blocks, running works, asyncio tasks "
    "and entries in `engine.stats`. A line is fitted to each series over the second half of the run; growth "
    "over that half above a threshold = unbounded growth. The KV pool is pre-faulted (written once) so RSS "
    "measures leaks, not the pool's first touch."
)

TIMEOUT = 300.0


def plan(quick: bool, duration: float | None = None) -> dict:
    return {
        "duration_s": float(duration if duration is not None else (30.0 if quick else 600.0)),
        "concurrency": 4,
        "kv_tokens": 4096,
        "shared_context": 256,
        "sample_every_s": 0.25,
        "interrupt_fraction": 0.4,
        "rss_abs_tol_mb": 32.0,
        "rss_rel_tol": 0.03,
    }


def estimate_s(p: dict, speed) -> float:
    return p["duration_s"] + 5


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


async def soak(ctx: SuiteContext, p: dict, *, leak_every: int = 0) -> dict:
    """Run the churn; leak_every=k keeps every k-th session's blocks (an injected leak, for tests)."""
    m = ctx.model
    engine = m.engine(kv_tokens=p["kv_tokens"])
    pool = engine.runner.store.pool
    pool.k.zero_()  # pre-fault: first touch of pool pages is not a leak
    pool.v.zero_()
    vocab = m.config.vocab_size
    samples: list[dict] = []
    counters: Counter = Counter()
    leaked: list = []
    async with engine:
        start = engine_idle_state(engine)
        start_tasks = len(asyncio.all_tasks())
        start_stats = len(engine.stats)
        shared = engine.block("shared-context")
        await within(
            engine.extend(shared, token_ids=document_tokens(m, ctx.seed, p["shared_context"]), name="setup"),
            TIMEOUT,
            "shared context",
        )
        t0 = time.perf_counter()
        stop_at = t0 + p["duration_s"]

        async def session(i: int) -> None:
            rng = random.Random(ctx.seed * 100_003 + i)
            name = f"session-{i}"
            blocks = []
            try:
                block = engine.block(name)
                blocks.append(block)
                await engine.extend(
                    block,
                    token_ids=random_token_ids(rng, vocab, rng.randint(8, 48)),
                    view=[shared, block],
                    name=name,
                )
                counters["extends"] += 1
                view = [shared, block]
                if rng.random() < 0.2:
                    fork = engine.fork(block, f"{name}-fork")
                    blocks.append(fork)
                    await engine.extend(
                        fork,
                        token_ids=random_token_ids(rng, vocab, rng.randint(2, 16)),
                        view=[shared, fork],
                        name=name,
                    )
                    view = [shared, fork]
                    counters["forks"] += 1
                if rng.random() < 0.3:
                    await engine.probe(
                        view, random_token_ids(rng, vocab, rng.randint(2, 8)), (" yes", " no"), name=name
                    )
                    counters["probes"] += 1
                result = await engine.generate(
                    view,
                    max_tokens=rng.randint(2, 8),
                    temperature=0.8,
                    seed=rng.randrange(1 << 30),
                    name=name,
                ).collect()
                counters["tokens"] += len(result.token_ids)
                counters["generations"] += 1
            finally:
                if leak_every and i % leak_every == 0:
                    leaked.extend(blocks)
                else:
                    for b in blocks:
                        engine.release(b)

        async def sampler() -> None:
            while True:
                mem = engine.memory()
                samples.append(
                    {
                        "t": time.perf_counter() - t0,
                        "rss_mb": rss_mb(),
                        "used_pages": mem.used_pages,
                        "live_blocks": mem.live_blocks,
                        "works": engine.occupancy().works,
                        "tasks": len(asyncio.all_tasks()),
                        "stats_entries": len(engine.stats),
                        "steps": engine.steps,
                    }
                )
                await asyncio.sleep(p["sample_every_s"])

        sampler_task = asyncio.create_task(sampler())
        running: set[asyncio.Task] = set()
        interrupter_rng = random.Random(ctx.seed + 7)
        i = 0
        while time.perf_counter() < stop_at:
            while len(running) < p["concurrency"]:
                task = asyncio.create_task(session(i), name=f"session-{i}")
                running.add(task)
                counters["sessions"] += 1
                if interrupter_rng.random() < p["interrupt_fraction"]:
                    delay = interrupter_rng.uniform(0.0, 0.5)
                    asyncio.get_running_loop().call_later(delay, task.cancel)
                i += 1
            done, running = await asyncio.wait(running, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.cancelled():
                    counters["interrupted"] += 1
                elif task.exception() is not None:
                    counters["errors"] += 1
                    counters[f"error:{type(task.exception()).__name__}"] += 1
            ctx.say(f"{time.perf_counter() - t0:.0f}/{p['duration_s']:.0f}s, {counters['sessions']} sessions")
        deadlock = False
        if running:
            done, pending = await asyncio.wait(running, timeout=TIMEOUT)
            deadlock = bool(pending)
            for task in done:
                if task.cancelled():
                    counters["interrupted"] += 1
        await asyncio.sleep(0.6)  # let scheduled cancels fire on finished tasks
        sampler_task.cancel()
        await asyncio.gather(sampler_task, return_exceptions=True)
        engine.release(shared)
        await asyncio.sleep(0)
        gc.collect()
        end = engine_idle_state(engine)
        end_tasks = len(asyncio.all_tasks())
        end_stats = len(engine.stats)
    return {
        "samples": samples,
        "start": start,
        "end": end,
        "start_tasks": start_tasks,
        "end_tasks": end_tasks,
        "counters": dict(counters),
        "deadlock": deadlock,
        "leaked_blocks": len(leaked),
        "stats_growth": end_stats - start_stats,
        "stats_entries": end_stats,
        "stats_cap": engine.limits.max_tracked_coroutines,
        "pool_pages": pool.num_pages,
    }


def verdicts(run: dict, p: dict) -> dict:
    """Trend per series and the end-of-run state (shared with the tests)."""
    s = run["samples"]
    ts = [x["t"] for x in s]
    trends = {
        "rss_mb": detect_growth(
            "rss_mb", ts, [x["rss_mb"] for x in s], abs_tol=p["rss_abs_tol_mb"], rel_tol=p["rss_rel_tol"]
        ),
        "used_pages": detect_growth(
            "used_pages", ts, [x["used_pages"] for x in s], abs_tol=max(4.0, 0.1 * run["pool_pages"])
        ),
        "live_blocks": detect_growth(
            "live_blocks", ts, [x["live_blocks"] for x in s], abs_tol=2.0 * p["concurrency"] + 2
        ),
        "tasks": detect_growth("tasks", ts, [x["tasks"] for x in s], abs_tol=p["concurrency"] + 2),
    }
    end_clean = (
        run["end"]["live_blocks"] == run["start"]["live_blocks"]
        and run["end"]["used_pages"] == run["start"]["used_pages"]
        and run["end"]["works"] == 0
        and run["end"]["writers"] == 0
        and run["end"]["holds"] == 0
    )
    return {"trends": trends, "end_clean": end_clean, "tasks_clean": run["end_tasks"] == run["start_tasks"]}


async def run(ctx: SuiteContext, p: dict) -> SuiteResult:
    res = SuiteResult(NAME, ctx.model.key, params=dict(p))
    r = await soak(ctx, p)
    v = verdicts(r, p)
    res.records = r["samples"]
    rows = [
        [
            t.name,
            fmt(t.first),
            fmt(t.last),
            fmt(t.slope_per_s * 60, 3),
            fmt(t.growth, 3),
            fmt(t.allowed, 3),
            "GROWING" if t.leaking else "bounded",
        ]
        for t in v["trends"].values()
    ]
    res.tables.append(
        Table(
            "Sampled series (second-half fit)",
            ["series", "first", "last", "slope per minute", "growth over 2nd half", "allowed", "verdict"],
            rows,
        )
    )
    c = r["counters"]
    res.tables.append(
        Table(
            "Churn",
            [
                "sessions",
                "interrupted",
                "errors",
                "extends",
                "forks",
                "probes",
                "generations",
                "tokens generated",
                "engine steps",
            ],
            [
                [
                    c.get("sessions", 0),
                    c.get("interrupted", 0),
                    c.get("errors", 0),
                    c.get("extends", 0),
                    c.get("forks", 0),
                    c.get("probes", 0),
                    c.get("generations", 0),
                    c.get("tokens", 0),
                    r["samples"][-1]["steps"] if r["samples"] else 0,
                ]
            ],
        )
    )
    res.tables.append(
        Table(
            "Engine state",
            [
                "when",
                "live blocks",
                "used pages",
                "free pages",
                "works",
                "writers",
                "held blocks",
                "asyncio tasks",
            ],
            [
                [
                    "start",
                    *[
                        r["start"][k]
                        for k in ("live_blocks", "used_pages", "free_pages", "works", "writers", "holds")
                    ],
                    r["start_tasks"],
                ],
                [
                    "end",
                    *[
                        r["end"][k]
                        for k in ("live_blocks", "used_pages", "free_pages", "works", "writers", "holds")
                    ],
                    r["end_tasks"],
                ],
            ],
        )
    )
    for name, t in v["trends"].items():
        res.check(
            f"{name} bounded (growth over the second half <= {t.allowed:.3g})",
            not t.leaking,
            f"fitted growth {t.growth:.3g}",
        )
    res.check("no block, page, work or hold left at the end", v["end_clean"], str(r["end"]))
    res.check("no asyncio task left at the end", v["tasks_clean"], f"{r['start_tasks']} -> {r['end_tasks']}")
    res.check("no session hung (all finished within the timeout)", not r["deadlock"])
    errs = {k: n for k, n in c.items() if k.startswith("error:")}
    res.check("no session failed with an error", not errs, str(errs))
    res.check(
        "engine.stats stays bounded (at most max_tracked_coroutines entries, oldest dropped)",
        r["stats_entries"] <= r["stats_cap"],
        f"{r['stats_growth']} entries added, {r['stats_entries']} held, cap {r['stats_cap']}",
        soft=True,
    )
    ts = [x["t"] for x in r["samples"]]
    lines(
        ctx.plot_path(NAME, "series"),
        f"{ctx.model.key}: soak ({p['duration_s']:.0f}s)",
        "seconds",
        [
            ("RSS (MiB)", [("rss", ts, [x["rss_mb"] for x in r["samples"]])]),
            ("KV pages used", [("used pages", ts, [x["used_pages"] for x in r["samples"]])]),
            (
                "count",
                [
                    ("live blocks", ts, [x["live_blocks"] for x in r["samples"]]),
                    ("works", ts, [x["works"] for x in r["samples"]]),
                    ("asyncio tasks", ts, [x["tasks"] for x in r["samples"]]),
                ],
            ),
        ],
        marker="",
    )
    res.plots.append(ctx.plot_path(NAME, "series").name)
    tr = v["trends"]
    res.summary = (
        f"{p['duration_s']:.0f} s, {c.get('sessions', 0)} sessions ({c.get('interrupted', 0)} interrupted): "
        f"RSS {tr['rss_mb'].first:.0f} -> {tr['rss_mb'].last:.0f} MiB (2nd-half growth "
        f"{tr['rss_mb'].growth:.1f} MiB), end state {'clean' if v['end_clean'] else 'NOT clean'}, "
        f"tasks {r['start_tasks']} -> {r['end_tasks']}, engine.stats +{r['stats_growth']} entries"
    )
    res.headline.update(
        {
            "duration_s": p["duration_s"],
            "sessions": c.get("sessions", 0),
            "interrupted": c.get("interrupted", 0),
            "rss_growth_2nd_half_mb": v["trends"]["rss_mb"].growth,
            "rss_first_mb": v["trends"]["rss_mb"].first,
            "rss_last_mb": v["trends"]["rss_mb"].last,
            "end_clean": v["end_clean"],
            "stats_entries_added": r["stats_growth"],
        }
    )
    res.conditions += [
        f"{p['duration_s']:.0f} s, {p['concurrency']} concurrent sessions, pool of {p['kv_tokens']} tokens; "
        "a short run cannot reveal leaks that only show over days (the framework's 7x24 run): use "
        "`--duration` for longer soaks",
        f"thresholds: RSS {p['rss_abs_tol_mb']:.0f} MiB or {p['rss_rel_tol']:.0%} over the second half; "
        "pages 10% "
        "of the pool; live blocks 2C+2",
    ]
    return res
