"""Suite 7: cost per unit of output, serial vs concurrent, and memory per coroutine.

K coroutines answer K questions about one shared document. Four ways to do the same work in the
same engine: text-passing (every coroutine re-encodes the document in its own block) serially and
concurrently, text-passing serially through the server's prefix cache (each prompt starts from the
longest cached prefix of an earlier one: the strongest form a text-passing stack deploys), and shared
memory (the document encoded once, each coroutine reads [document, own block]) serially and
concurrently. Outputs are greedy, so all modes must produce the same tokens.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

from cothink.eval.common import SuiteContext, SuiteResult, Table, fmt, plan_params, within
from cothink.eval.plots import bars
from cothink.eval.workload import document_tokens
from cothink.server.prefix_cache import PrefixCache

MODES = ("text serial", "text concurrent", "text serial + prefix cache", "shared serial", "shared concurrent")

NAME = "cost"
TITLE = "Cost per unit of output and memory per coroutine"
QUESTION = (
    "For the same output, how many tokens must be processed, how many forward passes and how much time does "
    "it take serially vs concurrently, and how much memory does each extra coroutine cost?"
)
METHOD = (
    "K coroutines each ask one question about a shared D-token document and generate G tokens (greedy). "
    "**text serial**: one at a time, each re-encodes the document (turn-based, no prefix cache); **text "
    "concurrent**: all at once, each with its own copy; **text serial + prefix cache**: one at a time "
    "through the server's prefix cache (a prompt starts from a fork of the longest cached prefix of an "
    "earlier prompt and prefills the rest); **shared serial**: the document is encoded once, "
    "coroutines run one at a time reading [document, own block]; **shared concurrent** (cothink): the same, "
    "all at once. Tokens processed and forward passes come from the engine's accounting; memory is the "
    "peak of KV bytes (+ Gated DeltaNet records) sampled after every step."
)

TIMEOUT = 900.0


@dataclass(frozen=True, slots=True)
class CostPlan:
    """The suite's knobs (written verbatim into config.json and the suite's params)."""

    coroutines: int  # K
    document: int  # D: tokens of the shared document
    new_tokens: int  # G: greedy tokens each coroutine writes


@dataclass(frozen=True, slots=True)
class CostRow:
    """One mode's run: a row of raw/cost-<model>.csv."""

    mode: str  # one of MODES
    wall_s: float  # seconds for the whole mode, the shared document's prefill included
    tokens_processed: int  # tokens run through the model, all coroutines (engine accounting)
    tokens_read: int  # view positions read, all coroutines (engine accounting)
    forward_passes: int  # engine steps
    output_tokens: int  # tokens generated, all coroutines
    peak_kv_bytes: int  # peak KV bytes in use, sampled after every step
    peak_linear_bytes: int  # peak Gated DeltaNet bytes (records and summaries)
    peak_pages: int  # peak KV pages in use
    page_bytes: int  # bytes of one KV page (16 tokens)
    doc_kv_bytes: int  # KV bytes of the shared document once encoded (0 in text modes)
    doc_linear_bytes: int  # Gated DeltaNet bytes of the shared document (0 in text modes)
    memory_per_coroutine_bytes: float  # peak minus the document, per coroutine alive at the peak
    tokens_per_output: float  # tokens_processed / output_tokens
    passes_per_output: float  # forward_passes / output_tokens
    seconds_per_output: float  # wall_s / output_tokens


@dataclass(frozen=True, slots=True)
class ModeRun:
    """One mode's row and the tokens each coroutine wrote (compared across modes, not written out)."""

    row: CostRow
    outputs: list[list[int] | None]  # per coroutine


def plan(quick: bool, duration: float | None = None) -> CostPlan:
    if quick:
        return CostPlan(coroutines=4, document=256, new_tokens=12)
    return CostPlan(coroutines=8, document=1024, new_tokens=32)


def _estimate_raw(p: CostPlan, speed) -> float:
    k, d, g = p.coroutines, p.document, p.new_tokens
    return (
        2 * k * d / speed.prefill_tps
        + d / speed.prefill_tps
        + k * g * speed.step_s * 2
        + 2 * g * speed.step_s * (1 + 0.35 * k)
        + 2 * k * 20 / speed.prefill_tps
    )


def estimate_s(p: CostPlan, speed) -> float:
    """Seconds, from the calibrated speed; the factor was fitted to measured quick runs on a 2-core CPU."""
    return 1.8 * _estimate_raw(p, speed)


async def _mode(ctx: SuiteContext, p: CostPlan, mode: str) -> ModeRun:
    m = ctx.model
    k, g = p.coroutines, p.new_tokens
    doc = document_tokens(m, ctx.seed, p.document)
    questions = [m.encode(f"\nQuestion {i + 1}: what did record {i + 1} report? Answer:") for i in range(k)]
    engine = m.engine(kv_tokens=(k + 1) * (p.document + 128) + 256)
    peak = {"kv": 0, "linear": 0, "pages": 0}

    def sample(_record) -> None:
        mem = engine.memory()
        peak["kv"] = max(peak["kv"], mem.kv_bytes_used)
        peak["linear"] = max(peak["linear"], mem.linear_bytes)
        peak["pages"] = max(peak["pages"], mem.used_pages)

    engine.step_listeners.append(sample)
    shared = mode.startswith("shared")
    cache = (
        PrefixCache(engine, 1 << 20, engine.runner.store.page_size) if mode.endswith("prefix cache") else None
    )
    outputs: list[list[int] | None] = [None] * k
    async with engine:
        t0 = time.perf_counter()
        doc_block = None
        if shared:
            doc_block = engine.block("document")
            await within(engine.extend(doc_block, token_ids=doc, name="document"), TIMEOUT, "document")
        doc_mem = engine.memory()

        async def coroutine(i: int) -> None:
            name = f"coroutine-{i}"
            # through the prefix cache, a prompt starts as a fork of the longest cached prefix
            prompt = questions[i] if shared else doc + questions[i]
            block, hit = cache.start("eval", prompt, name) if cache is not None else (engine.block(name), 0)
            view = [doc_block, block] if doc_block is not None else [block]
            try:
                await engine.extend(block, token_ids=prompt[hit:], view=view, name=name)
                if cache is not None:
                    cache.insert("eval", prompt, block)
                res = await engine.generate(view, max_tokens=g, stop_at_eos=False, name=name).collect()
                outputs[i] = res.token_ids
            finally:
                sample(None)
                engine.release(block)

        if mode.endswith("concurrent"):
            await within(asyncio.gather(*[coroutine(i) for i in range(k)]), TIMEOUT, mode)
        else:
            for i in range(k):
                await within(coroutine(i), TIMEOUT, mode)
        wall = time.perf_counter() - t0
        if doc_block is not None:
            engine.release(doc_block)
        if cache is not None:
            cache.clear()
    tokens = sum(s.tokens_written for s in engine.stats.values())
    reads = sum(s.tokens_read for s in engine.stats.values())
    out_tokens = sum(len(o or []) for o in outputs)
    page_bytes = engine.memory().page_bytes
    mem = peak["kv"] + peak["linear"]
    doc_kv = doc_mem.kv_bytes_used if shared else 0
    doc_linear = doc_mem.linear_bytes if shared else 0
    if not mode.endswith("concurrent"):
        per = mem - doc_kv - doc_linear  # one coroutine alive at a time (and, cached, the cache's forks)
    else:
        per = (mem - doc_kv - doc_linear) / k
    row = CostRow(
        mode=mode,
        wall_s=wall,
        tokens_processed=tokens,
        tokens_read=reads,
        forward_passes=engine.steps,
        output_tokens=out_tokens,
        peak_kv_bytes=peak["kv"],
        peak_linear_bytes=peak["linear"],
        peak_pages=peak["pages"],
        page_bytes=page_bytes,
        doc_kv_bytes=doc_kv,
        doc_linear_bytes=doc_linear,
        memory_per_coroutine_bytes=per,
        tokens_per_output=tokens / out_tokens,
        passes_per_output=engine.steps / out_tokens,
        seconds_per_output=wall / out_tokens,
    )
    return ModeRun(row, outputs)


async def run(ctx: SuiteContext, p: CostPlan) -> SuiteResult:
    res = SuiteResult(NAME, ctx.model.key, params=plan_params(p))
    runs: dict[str, ModeRun] = {}
    for mode in MODES:
        ctx.say(mode)
        runs[mode] = await _mode(ctx, p, mode)
    k = p.coroutines
    results = {mode: r.row for mode, r in runs.items()}
    res.records = [asdict(r) for r in results.values()]
    rows = [
        [
            r.mode,
            r.output_tokens,
            r.tokens_processed,
            fmt(r.tokens_per_output, 2),
            r.forward_passes,
            fmt(r.passes_per_output, 3),
            fmt(r.wall_s),
            fmt(r.seconds_per_output, 3),
            fmt((r.peak_kv_bytes + r.peak_linear_bytes) / 2**20, 3),
            fmt(r.memory_per_coroutine_bytes / 2**20, 3),
        ]
        for r in results.values()
    ]
    res.tables.append(
        Table(
            f"{k} coroutines x {p.new_tokens} new tokens over a {p.document}-token document",
            [
                "mode",
                "output tokens",
                "tokens processed",
                "tokens / output token",
                "forward passes",
                "passes / output token",
                "wall s",
                "s / output token",
                "peak memory MiB (KV + GDN)",
                "memory per coroutine MiB",
            ],
            rows,
            note="memory per coroutine: peak minus the shared document, divided by the coroutines alive at "
            "the peak "
            "(1 when serial); pages are 16 tokens, so small blocks round up",
        )
    )
    ref = runs["text serial"].outputs
    same = all(r.outputs == ref for r in runs.values())
    res.check("all modes produce the same tokens (greedy)", same)
    tc, sc = results["text concurrent"], results["shared concurrent"]
    ts = results["text serial"]
    res.check(
        "shared concurrent processes fewer tokens per output token than text serial",
        sc.tokens_processed < ts.tokens_processed,
        f"{sc.tokens_processed} vs {ts.tokens_processed}",
    )
    res.check(
        "shared concurrent needs fewer forward passes than serial",
        sc.forward_passes < ts.forward_passes,
        f"{sc.forward_passes} vs {ts.forward_passes}",
    )
    tp = results["text serial + prefix cache"]
    res.check(
        "the prefix-cache baseline reuses the document (it processes fewer tokens than text serial)",
        tp.tokens_processed < ts.tokens_processed,
        f"{tp.tokens_processed} vs {ts.tokens_processed}",
    )
    res.check(
        "shared concurrent needs fewer forward passes than text serial with the prefix cache",
        sc.forward_passes < tp.forward_passes,
        f"{sc.forward_passes} vs {tp.forward_passes}",
    )
    res.info(
        "tokens processed: shared concurrent vs text serial with the prefix cache",
        f"{sc.tokens_processed} vs {tp.tokens_processed}: with a prefix cache, text passing re-encodes only "
        "what follows the longest cached prefix, so its compute approaches shared memory's",
    )
    res.check(
        "per-coroutine memory is smaller when the document is shared",
        sc.memory_per_coroutine_bytes < tc.memory_per_coroutine_bytes,
        f"{sc.memory_per_coroutine_bytes / 2**20:.2f} vs {tc.memory_per_coroutine_bytes / 2**20:.2f} MiB",
    )
    res.headline.update(
        {
            "tokens_per_output_text_serial": ts.tokens_per_output,
            "tokens_per_output_shared_concurrent": sc.tokens_per_output,
            "passes_per_output_text_serial": ts.passes_per_output,
            "passes_per_output_shared_concurrent": sc.passes_per_output,
            "s_per_output_text_serial": ts.seconds_per_output,
            "s_per_output_shared_concurrent": sc.seconds_per_output,
            "mib_per_coroutine_text": tc.memory_per_coroutine_bytes / 2**20,
            "mib_per_coroutine_shared": sc.memory_per_coroutine_bytes / 2**20,
            "kv_bytes_per_token": results["text serial"].page_bytes / 16,
        }
    )
    res.summary = (
        f"per output token: text serial {ts.tokens_processed / ts.output_tokens:.1f} tokens, "
        f"{ts.forward_passes / ts.output_tokens:.2f} passes, "
        f"{1000 * ts.wall_s / ts.output_tokens:.0f} ms; "
        f"shared concurrent {sc.tokens_processed / sc.output_tokens:.1f} tokens, "
        f"{sc.forward_passes / sc.output_tokens:.2f} passes, "
        f"{1000 * sc.wall_s / sc.output_tokens:.0f} ms; "
        f"memory per coroutine {tc.memory_per_coroutine_bytes / 2**20:.2f} MiB (own copy) vs "
        f"{sc.memory_per_coroutine_bytes / 2**20:.2f} MiB (shared)"
    )
    modes = list(results)
    bars(
        ctx.plot_path(NAME, "per-output"),
        f"{ctx.model.key}: cost per output token",
        ["tokens", "passes x10", "ms"],
        [
            (
                mode,
                [
                    results[mode].tokens_processed / results[mode].output_tokens,
                    10 * results[mode].forward_passes / results[mode].output_tokens,
                    1000 * results[mode].wall_s / results[mode].output_tokens,
                ],
            )
            for mode in modes
        ],
        "per output token",
        logy=True,
    )
    res.plots.append(ctx.plot_path(NAME, "per-output").name)
    res.conditions += [
        f"K={k} coroutines, D={p.document}-token document, G={p.new_tokens} greedy tokens each, "
        "prompts of "
        "~15 tokens; one engine per mode, default scheduler limits",
        "text serial and text concurrent model a stack without prefix caching; text serial + prefix cache "
        "uses the server's prefix cache (one account): a cached document costs its compute once, but a "
        "coroutine still sees another's output only as text it re-reads",
        f"KV bytes per token: {ts.page_bytes // 16} ({ctx.model.info['attention_layers']} attention "
        "layers)"
        + (
            f"; Gated DeltaNet layers keep per-token records ({ctx.model.info['linear_layers']} layers) and "
            "dense "
            "summaries for long blocks"
            if ctx.model.is_hybrid
            else ""
        ),
    ]
    return res
