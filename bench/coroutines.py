"""Decode throughput and KV memory vs the number of coroutines sharing one context.

    python bench/coroutines.py             # ~5 minutes on a 2-core CPU
    python bench/coroutines.py --quick     # ~1 minute

cothink: one context block of --context random tokens, prefilled once; N coroutines each write --suffix
tokens of their own (distinct random tokens) into their own block and then generate --new-tokens tokens
greedily there, reading [ctx, own]. transformers: the same N prompts (context + suffix) as independent
sequences, two ways: **batched** (one [N, context+suffix] prefill, then one [N, 1] forward per token with
a DynamicCache: what `generate` does, without its overheads) and **sequential** (the N prompts one after
another, batch 1). Decode tokens/s counts the N x new-tokens generated tokens over the decode phase
only; end-to-end adds the prompt prefill (cothink prefills the context once, transformers N times).
Sequential runs cost N times a single one, so by default they are measured for N <= --sequential-max
and extrapolated (marked) above it.

"Linears alone": the linear layers of one N-row cothink decode step (recorded by hooks) replayed back
to back with nothing else; N / that time bounds the N-coroutine decode rate on the same kernels.

Memory: cothink's KV in use (engine.memory().kv_bytes_used) with all N coroutines' blocks alive, against
N copies of the one-coroutine KV, and the transformers DynamicCache of the batched run.
Writes coroutines.json and coroutines.png to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from pathlib import Path
from typing import Any

import cothink  # noqa: E402  sets the OpenMP wait policy, so it precedes torch
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_common_args(p)
    p.add_argument("--dtype", choices=list(C.DTYPES), default="float32")
    p.add_argument(
        "--coroutines",
        type=int,
        nargs="+",
        default=None,
        help="values of N; 1 is always added (default: 1 2 4 8 16 32; --quick: 1 2 4 8)",
    )
    p.add_argument(
        "--context", type=int, default=None, help="shared context tokens (default: 256; quick: 128)"
    )
    p.add_argument("--suffix", type=int, default=8, help="each coroutine's own prompt tokens (default: 8)")
    p.add_argument(
        "--new-tokens", type=int, default=None, help="tokens each coroutine generates (default: 32)"
    )
    p.add_argument(
        "--sequential-max",
        type=int,
        default=None,
        help="largest N for which transformers sequential is measured (default: 4; quick: 2)",
    )
    p.add_argument(
        "--contention",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run cothink at the largest N while another process keeps one core busy "
        "(default: on, off with --quick)",
    )
    args = p.parse_args(argv)
    q = args.quick
    args.coroutines = args.coroutines or ([1, 2, 4, 8] if q else [1, 2, 4, 8, 16, 32])
    if min(args.coroutines) < 1:
        p.error("--coroutines: every N must be at least 1")
    # N=1 is the baseline of the sequential extrapolation and of the KV copies: always measured, first
    args.coroutines = sorted({1, *args.coroutines})
    args.context = args.context or (128 if q else 256)
    args.new_tokens = args.new_tokens or (16 if q else 32)
    args.sequential_max = args.sequential_max if args.sequential_max is not None else (2 if q else 4)
    args.contention = (not q) if args.contention is None else args.contention
    return args


# -------------------------------------------------------------------------------------------- cothink


async def co_run(
    engine: Any, ctx_ids: list[int], suffixes: list[list[int]], new_tokens: int
) -> dict[str, Any]:
    """Context once, N suffixes, N concurrent greedy generations; blocks released at the end."""
    steps0 = engine.steps
    t0 = time.perf_counter()
    ctx = engine.block("ctx")
    await engine.extend(ctx, token_ids=ctx_ids, name="context")
    own = [engine.block(f"coroutine-{i}") for i in range(len(suffixes))]
    await asyncio.gather(
        *(
            engine.extend(b, token_ids=s, view=[ctx, b], name=f"coroutine-{i}")
            for i, (b, s) in enumerate(zip(own, suffixes))
        )
    )
    t1 = time.perf_counter()
    steps1 = engine.steps
    results = await asyncio.gather(
        *(
            engine.generate(
                [ctx, b], max_tokens=new_tokens, stop_at_eos=False, name=f"coroutine-{i}"
            ).collect()
            for i, b in enumerate(own)
        )
    )
    t2 = time.perf_counter()
    mem = engine.memory()
    out = {
        "prefill_s": t1 - t0,
        "decode_s": t2 - t1,
        "total_s": t2 - t0,
        "decode_steps": engine.steps - steps1,
        "prefill_steps": steps1 - steps0,
        "generated": sum(len(r.token_ids) for r in results),
        "kv_bytes_used": mem.kv_bytes_used,
        "linear_bytes": mem.linear_bytes,
        "used_pages": mem.used_pages,
        "page_size": mem.page_size,
        "tokens": [r.token_ids for r in results],
    }
    for b in own:
        engine.release(b)
    engine.release(ctx)
    return out


# --------------------------------------------------------------------------------------- transformers


@torch.inference_mode()
def hf_batched(model: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """All prompts (same length) as one batch: prefill, then new_tokens one-token forwards."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)  # per layer type (hybrid models need it)
    t0 = time.perf_counter()
    out = model(torch.tensor(prompts), past_key_values=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    t1 = time.perf_counter()
    tokens = []
    for _ in range(new_tokens):
        tokens.append(nxt)
        out = model(nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    t2 = time.perf_counter()
    return {
        "prefill_s": t1 - t0,
        "decode_s": t2 - t1,
        "total_s": t2 - t0,
        "cache_bytes": C.cache_bytes(cache),
        "generated": len(prompts) * new_tokens,
        "tokens": torch.cat(tokens, 1).tolist(),
    }


def hf_sequential(model: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    runs = [hf_batched(model, [p], new_tokens) for p in prompts]
    return {k: sum(r[k] for r in runs) for k in ("prefill_s", "decode_s", "total_s", "generated")} | {
        "cache_bytes_each": runs[0]["cache_bytes"],
        "measured": True,
    }


# ------------------------------------------------------------------------------------------------ run


async def measure(args: argparse.Namespace, folder: Path, console: Any) -> dict[str, Any]:

    dtype = C.DTYPES[args.dtype]
    vocab = C.vocab_size(folder)
    gen = torch.Generator().manual_seed(args.seed)
    n_max = max(args.coroutines)
    per = args.suffix + args.new_tokens
    t0 = time.perf_counter()
    engine = cothink.Engine.from_pretrained(
        folder,
        dtype=dtype,
        kv_tokens=args.context + n_max * (per + 16) + 256,
        max_batch_items=max(64, n_max),
        max_batch_tokens=max(256, n_max * args.suffix, args.context),
        max_prefill_chunk=max(128, args.context),
    )
    hf = C.on_compute(C.load_hf, folder, dtype)
    console.print(f"[dim]loaded both models in {time.perf_counter() - t0:.1f}s[/dim]")
    ctx_ids = C.random_tokens(args.context, vocab, gen, low=100)
    suffixes = [C.random_tokens(args.suffix, vocab, gen, low=100) for _ in range(n_max)]
    rows = []
    async with engine:
        await co_run(engine, ctx_ids, suffixes[:1], 2)  # warm-up
        C.on_compute(hf_batched, hf, [ctx_ids + suffixes[0]], 2)
        single_kv = None
        for n in args.coroutines:
            prompts = [ctx_ids + s for s in suffixes[:n]]
            co = await co_run(engine, ctx_ids, suffixes[:n], args.new_tokens)
            hb = C.on_compute(hf_batched, hf, prompts, args.new_tokens)
            if n <= args.sequential_max:
                hs = C.on_compute(hf_sequential, hf, prompts, args.new_tokens)
            else:  # N independent runs cost N times one run: extrapolate from the N=1 measurement
                one = rows[0]["hf_sequential"]
                hs = {k: one[k] * n for k in ("prefill_s", "decode_s", "total_s", "generated")} | {
                    "cache_bytes_each": one["cache_bytes_each"],
                    "measured": False,
                }
            if single_kv is None:
                single_kv = co["kv_bytes_used"] if n == 1 else None
            agree = sum(a == b for a, b in zip(co["tokens"], hb["tokens"]))
            row = {
                "n": n,
                "cothink": {k: v for k, v in co.items() if k != "tokens"},
                "hf_batched": {k: v for k, v in hb.items() if k != "tokens"},
                "hf_sequential": hs,
                "cothink_decode_tok_s": co["generated"] / co["decode_s"],
                "hf_batched_decode_tok_s": hb["generated"] / hb["decode_s"],
                "hf_sequential_decode_tok_s": hs["generated"] / hs["decode_s"],
                "cothink_e2e_tok_s": co["generated"] / co["total_s"],
                "hf_batched_e2e_tok_s": hb["generated"] / hb["total_s"],
                "hf_sequential_e2e_tok_s": hs["generated"] / hs["total_s"],
                "cothink_kv_bytes": co["kv_bytes_used"],
                "n_copies_kv_bytes": None,
                "hf_cache_bytes": hb["cache_bytes"],
                "sequences_agreeing_with_hf": agree,
            }
            rows.append(row)
            console.print(
                f"  N={n:>2}: decode tok/s cothink {row['cothink_decode_tok_s']:7.1f}, "
                f"HF batched {row['hf_batched_decode_tok_s']:7.1f}, "
                f"HF sequential {row['hf_sequential_decode_tok_s']:7.1f}"
                f"{'' if hs['measured'] else ' (extrapolated)'}; "
                f"KV cothink {co['kv_bytes_used'] / 2**20:.1f} MiB, "
                f"HF cache {hb['cache_bytes'] / 2**20:.1f} MiB; {agree}/{n} greedy sequences equal HF's"
            )
        # the N-row decode step's matmuls alone (bench/_common.py LinearCalls): a bound for this N
        with C.LinearCalls(engine.runner) as calls:
            await co_run(engine, ctx_ids, suffixes[:n_max], 2)
        step = calls.last_with_rows(n_max)
        step_s = C.on_compute(C.LinearCalls.seconds, step, dtype, 3 if args.quick else 6)
        cothink_tok_s = rows[-1]["cothink_decode_tok_s"]
        linears = {"n": n_max, "tok_s": n_max / step_s, "of_it": cothink_tok_s * step_s / n_max}
        console.print(
            f"  N={n_max}: the decode step's linears alone {linears['tok_s']:.1f} tok/s "
            f"(cothink at {linears['of_it']:.2f} of it)"
        )
    contention = None
    async with engine:
        if single_kv is None:  # N=1 not in the sweep: measure it
            single_kv = (await co_run(engine, ctx_ids, suffixes[:1], args.new_tokens))["kv_bytes_used"]
        if args.contention:
            with C.BusyCore():
                busy = await co_run(engine, ctx_ids, suffixes[:n_max], args.new_tokens)
            tok_s = busy["generated"] / busy["decode_s"]
            contention = {
                "n": n_max,
                "decode_tok_s": tok_s,
                "of_quiet": tok_s / rows[-1]["cothink_decode_tok_s"],
            }
            console.print(
                f"  one core busy, N={n_max}: cothink decode {tok_s:.1f} tok/s "
                f"({contention['of_quiet']:.2f} of quiet)"
            )
    for row in rows:
        row["n_copies_kv_bytes"] = row["n"] * single_kv
    del engine, hf
    gc.collect()
    return {
        "rows": rows,
        "single_coroutine_kv_bytes": single_kv,
        "contention": contention,
        "linears_alone": linears,
    }


def tables(res: dict[str, Any]) -> list[Any]:
    from rich.table import Table

    thr = Table(title="decode tokens/s (end-to-end tokens/s incl. prompt prefill)", title_justify="left")
    for col in ("N", "cothink", "HF batched", "HF sequential", "cothink / HF batched", "cothink / HF seq"):
        thr.add_column(col, justify="right")
    mem = Table(title="KV memory (MiB)", title_justify="left")
    for col in ("N", "cothink (shared ctx)", "N copies", "HF DynamicCache (batched)", "cothink / N copies"):
        mem.add_column(col, justify="right")
    for r in res["rows"]:
        seq_mark = "" if r["hf_sequential"]["measured"] else "*"
        thr.add_row(
            str(r["n"]),
            f"{r['cothink_decode_tok_s']:.1f} ({r['cothink_e2e_tok_s']:.1f})",
            f"{r['hf_batched_decode_tok_s']:.1f} ({r['hf_batched_e2e_tok_s']:.1f})",
            f"{r['hf_sequential_decode_tok_s']:.1f}{seq_mark} ({r['hf_sequential_e2e_tok_s']:.1f}{seq_mark})",
            f"{C.ratio(r['cothink_decode_tok_s'], r['hf_batched_decode_tok_s']):.2f}",
            f"{C.ratio(r['cothink_decode_tok_s'], r['hf_sequential_decode_tok_s']):.2f}",
        )
        mem.add_row(
            str(r["n"]),
            f"{r['cothink_kv_bytes'] / 2**20:.2f}",
            f"{r['n_copies_kv_bytes'] / 2**20:.2f}",
            f"{r['hf_cache_bytes'] / 2**20:.2f}",
            f"{C.ratio(r['cothink_kv_bytes'], r['n_copies_kv_bytes']):.2f}",
        )
    notes = []
    if any(not r["hf_sequential"]["measured"] for r in res["rows"]):
        notes.append("* extrapolated: N x the measured N=1 sequential run")
    lin = res.get("linears_alone")
    if lin:
        notes.append(
            f"N={lin['n']}: the step's linears alone {lin['tok_s']:.1f} tok/s; "
            f"cothink at {lin['of_it']:.2f} of it"
        )
    if notes:
        thr.caption = "\n".join(notes)
        thr.caption_justify = "left"
    return [thr, mem]


def plot(res: dict[str, Any], path: Path, title: str) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = res["rows"]
    ns = [r["n"] for r in rows]
    fig = Figure(figsize=(11, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    ax1.plot(ns, [r["cothink_decode_tok_s"] for r in rows], "o-", label="cothink (N coroutines, shared ctx)")
    ax1.plot(ns, [r["hf_batched_decode_tok_s"] for r in rows], "s-", label="transformers, batched")
    ax1.plot(ns, [r["hf_sequential_decode_tok_s"] for r in rows], "^--", label="transformers, sequential")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(ns, [str(n) for n in ns])
    ax1.set_xlabel("N (coroutines / sequences)")
    ax1.set_ylabel("decode tokens/s")
    ax1.set_title("decode throughput")
    ax1.legend(fontsize="small")
    ax1.grid(alpha=0.3)
    mib = 2**20
    ax2.plot(ns, [r["cothink_kv_bytes"] / mib for r in rows], "o-", label="cothink (shared ctx)")
    ax2.plot(ns, [r["n_copies_kv_bytes"] / mib for r in rows], "x--", label="N copies of one coroutine's KV")
    ax2.plot(ns, [r["hf_cache_bytes"] / mib for r in rows], "s-", label="transformers DynamicCache (batched)")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(ns, [str(n) for n in ns])
    ax2.set_xlabel("N")
    ax2.set_ylabel("KV MiB")
    ax2.set_title("KV memory")
    ax2.legend(fontsize="small")
    ax2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    C.setup(args)
    console = C.console()
    folder = C.model_folder(args.model)
    info = C.machine()
    console.print(
        f"[bold]coroutines[/bold]: {args.model} {args.dtype}, context {args.context} + {args.suffix} own "
        f"tokens, {args.new_tokens} new tokens each; {C.machine_line(info)}"
    )
    t0 = time.perf_counter()
    res = asyncio.run(measure(args, folder, console))
    console.print()
    for table in tables(res):
        console.print(table)
    data = {
        "benchmark": "coroutines",
        "model": args.model,
        "machine": info,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "results": res,
        "wall_s": time.perf_counter() - t0,
    }
    js = C.write_json(args.out / "coroutines.json", data)
    png = plot(
        res,
        args.out / "coroutines.png",
        f"{Path(args.model).name} {args.dtype}: {args.context}-token shared context, "
        f"{args.new_tokens} new tokens each",
    )
    console.print(f"wrote {js} and {png} ({data['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
