"""Prefill and decode throughput: cothink vs transformers on the same model, dtype and torch threads.

    python bench/prefill_decode.py            # ~5 minutes on a 2-core CPU: float32 and bfloat16
    python bench/prefill_decode.py --quick    # ~1 minute

Prefill: one prompt of L random tokens (L in --lengths) written in one forward pass; cothink through the
engine (``engine.extend`` on a fresh block, scheduler limits raised so the prompt is one chunk),
transformers as ``model(ids, logits_to_keep=1)`` with a fresh DynamicCache. Decode: greedy,
--decode-tokens tokens after a --decode-prompt token prompt, one forward per token on both sides
(cothink: ``engine.generate``; transformers: a manual loop feeding each token with ``past_key_values``).
Each measurement is the best of --repeats runs (after a warm-up at the first length); cothink and
transformers alternate within each repeat. The ratios are cothink / transformers (above 1: cothink is
faster). Dtypes "int8" and "int4" are cothink with weight-only int8 or 4-bit linears (bfloat16
activations) against transformers in bfloat16.

Limits, measured in the same run per dtype (bench/_common.py): GEMV bandwidth over a weight larger
than the caches, and GEMM GFLOP/s, each the faster of `F.linear` and the kernel cothink's fast path
uses for the dtype on this CPU (oneDNN-prepacked bfloat16, or bfloat16 widened to float32 where the
CPU has no bfloat16 arithmetic: models/packing.py). The decode limit is bandwidth / the bytes of
weights a step reads; the prefill limit is GEMM GFLOP/s / (2 x linear parameters) tokens/s
(attention not counted). Each cothink figure is also printed as a fraction of its limit. "Linears
alone": the linear layers one cothink decode step calls (recorded by hooks), replayed back to back
with nothing else, through the same modules and kernels; layer-sized matrices stream slower than the
one big GEMV of the limit, so this is the tighter bound on decode for any engine on torch's kernels.
--contention (on by default in full runs) repeats decode and the first prefill length while another
process keeps one core busy.
Writes prefill_decode.json and prefill_decode.png to --out.
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
    p.add_argument(
        "--dtypes",
        nargs="+",
        choices=list(C.COMPUTE_DTYPES),
        default=None,
        help="dtypes to measure (default: float32 bfloat16 int8; int4 on request)",
    )
    p.add_argument(
        "--lengths", type=int, nargs="+", default=None, help="prefill lengths (default: 128 512 2048)"
    )
    p.add_argument("--decode-tokens", type=int, default=None, help="tokens to decode (default: 64)")
    p.add_argument(
        "--decode-prompt", type=int, default=128, help="prompt length before decoding (default: 128)"
    )
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (default: 2)")
    p.add_argument(
        "--contention",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also measure with one core kept busy by another process (default: on, off with --quick)",
    )
    args = p.parse_args(argv)
    quick = args.quick
    args.contention = (not quick) if args.contention is None else args.contention
    args.dtypes = args.dtypes or ["float32", "bfloat16", "int8"]
    args.lengths = args.lengths or ([128, 512] if quick else [128, 512, 2048])
    args.decode_tokens = args.decode_tokens or (16 if quick else 64)
    args.repeats = args.repeats or (1 if quick else 2)
    return args


# --------------------------------------------------------------------------------------- transformers


@torch.inference_mode()
def hf_prefill(model: Any, ids: list[int]) -> float:
    from transformers import DynamicCache

    x = torch.tensor([ids])
    t = time.perf_counter()
    model(x, past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t


@torch.inference_mode()
def hf_decode(model: Any, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """Greedy: prefill (not timed), then n forwards of one token each; returns (seconds, tokens)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)  # per layer type (hybrid models need it)
    out = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    nxt = int(out.logits[0, -1].argmax())
    tokens = []
    t = time.perf_counter()
    for _ in range(n):
        tokens.append(nxt)
        out = model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
        nxt = int(out.logits[0, -1].argmax())
    return time.perf_counter() - t, tokens


# -------------------------------------------------------------------------------------------- cothink


async def co_prefill(engine: Any, ids: list[int]) -> float:
    block = engine.block("prefill")
    t = time.perf_counter()
    await engine.extend(block, token_ids=ids)
    dt = time.perf_counter() - t
    engine.release(block)
    return dt


async def co_decode(engine: Any, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """Greedy: prefill (not timed), then generate n tokens (n forwards); returns (seconds, tokens)."""
    block = engine.block("decode")
    await engine.extend(block, token_ids=prompt)
    t = time.perf_counter()
    result = await engine.generate(block, max_tokens=n, stop_at_eos=False).collect()
    dt = time.perf_counter() - t
    engine.release(block)
    return dt, result.token_ids


# ------------------------------------------------------------------------------------------------ run


async def measure_dtype(
    args: argparse.Namespace, folder: Path, dtype_name: str, console: Any
) -> dict[str, Any]:

    dtype = C.COMPUTE_DTYPES[dtype_name]
    vocab = C.vocab_size(folder)
    gen = torch.Generator().manual_seed(args.seed)
    longest = max(max(args.lengths), args.decode_prompt + args.decode_tokens)
    t0 = time.perf_counter()
    engine = cothink.Engine.from_pretrained(
        folder,
        dtype=dtype,
        kv_tokens=2 * longest + 256,
        max_batch_tokens=longest,
        max_prefill_chunk=longest,
        quantize=C.quantize_of(dtype_name),
    )
    hf = C.on_compute(C.load_hf, folder, dtype)
    console.print(f"[dim]{dtype_name}: loaded both models in {time.perf_counter() - t0:.1f}s[/dim]")
    out: dict[str, Any] = {"prefill": [], "decode": {}}
    threads = torch.get_num_threads()
    limits = C.on_compute(C.measure_limits, dtype, threads, args.quick)
    weight_bytes = C.streamed_weight_bytes(hf, dtype_name)
    params = C.linear_parameters(hf)
    limits["weight_bytes"] = weight_bytes
    limits["decode_tok_s"] = limits["gemv_gb_s"] * 1e9 / weight_bytes
    limits["prefill_tok_s"] = limits["gemm_gflop_s"] * 1e9 / (2 * params)
    out["limits"] = limits
    console.print(
        f"  limits: GEMV {limits['gemv_gb_s']:.1f} GB/s over {weight_bytes / 2**20:.0f} MiB of weights -> "
        f"decode {limits['decode_tok_s']:.1f} tok/s; GEMM {limits['gemm_gflop_s']:.0f} GFLOP/s -> "
        f"prefill {limits['prefill_tok_s']:.0f} tok/s"
    )
    async with engine:
        for length in args.lengths:
            ids = C.random_tokens(length, vocab, gen, low=100)
            if length == args.lengths[0]:  # warm-up (once: later lengths reuse the warmed-up paths)
                await co_prefill(engine, ids)
                C.on_compute(hf_prefill, hf, ids)
            co_t, hf_t = [], []
            for _ in range(args.repeats):
                co_t.append(await co_prefill(engine, ids))
                hf_t.append(C.on_compute(hf_prefill, hf, ids))
            row = {
                "length": length,
                "cothink_s": co_t,
                "hf_s": hf_t,
                "cothink_tok_s": length / min(co_t),
                "hf_tok_s": length / min(hf_t),
            }
            row["ratio"] = C.ratio(row["cothink_tok_s"], row["hf_tok_s"])
            row["of_limit"] = row["cothink_tok_s"] / limits["prefill_tok_s"]
            row["hf_of_limit"] = row["hf_tok_s"] / limits["prefill_tok_s"]
            out["prefill"].append(row)
            console.print(
                f"  prefill {length:>5}: cothink {row['cothink_tok_s']:8.1f} tok/s, "
                f"transformers {row['hf_tok_s']:8.1f} tok/s, ratio {row['ratio']:.2f}"
            )

        prompt = C.random_tokens(args.decode_prompt, vocab, gen, low=100)
        n = args.decode_tokens
        await co_decode(engine, prompt, min(n, 4))  # warm-up
        C.on_compute(hf_decode, hf, prompt, min(n, 4))
        with C.LinearCalls(engine.runner) as calls:  # one decode step's matmuls, replayed alone
            await co_decode(engine, prompt, 2)
        step = calls.last_with_rows(1)
        step_s = C.on_compute(C.LinearCalls.seconds, step, dtype, 3 if args.quick else 8)
        limits["linears_decode_tok_s"] = 1 / step_s
        co_t, hf_t = [], []
        agree = None
        for _ in range(args.repeats):
            dt, co_tokens = await co_decode(engine, prompt, n)
            co_t.append(dt)
            dt, hf_tokens = C.on_compute(hf_decode, hf, prompt, n)
            hf_t.append(dt)
            same = next((i for i, (a, b) in enumerate(zip(co_tokens, hf_tokens)) if a != b), n)
            agree = same if agree is None else min(agree, same)
        row = {
            "prompt": args.decode_prompt,
            "tokens": n,
            "cothink_s": co_t,
            "hf_s": hf_t,
            "cothink_tok_s": n / min(co_t),
            "hf_tok_s": n / min(hf_t),
            "greedy_tokens_agreeing": agree,
        }
        row["ratio"] = C.ratio(row["cothink_tok_s"], row["hf_tok_s"])
        row["of_limit"] = row["cothink_tok_s"] / limits["decode_tok_s"]
        row["hf_of_limit"] = row["hf_tok_s"] / limits["decode_tok_s"]
        row["of_linears"] = row["cothink_tok_s"] / limits["linears_decode_tok_s"]
        out["decode"] = row
        console.print(
            f"  decode  {n:>5}: cothink {row['cothink_tok_s']:8.1f} tok/s, "
            f"transformers {row['hf_tok_s']:8.1f} tok/s, ratio {row['ratio']:.2f} "
            f"(greedy tokens agree for the first {agree} of {n}); the step's linears alone "
            f"{limits['linears_decode_tok_s']:.1f} tok/s"
        )
        if args.contention:
            out["contention"] = await contention(args, engine, hf, prompt, ids_first(args, vocab), out)
            c = out["contention"]
            console.print(
                f"  one core busy: decode {c['decode_tok_s']:.1f} tok/s "
                f"({c['decode_of_quiet']:.2f} of quiet; "
                f"transformers {c['hf_decode_tok_s']:.1f}), prefill {c['length']} "
                f"{c['prefill_tok_s']:.1f} tok/s ({c['prefill_of_quiet']:.2f} of quiet)"
            )
    del engine, hf
    gc.collect()
    return out


def ids_first(args: argparse.Namespace, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(args.seed + 1)
    return C.random_tokens(args.lengths[0], vocab, gen, low=100)


async def contention(
    args: argparse.Namespace, engine: Any, hf: Any, prompt: list[int], ids: list[int], quiet: dict[str, Any]
) -> dict[str, Any]:
    """Decode and the first prefill length again while another process keeps one core busy."""
    n = args.decode_tokens
    with C.BusyCore():
        co_d = min([(await co_decode(engine, prompt, n))[0] for _ in range(args.repeats)])
        hf_d = min([C.on_compute(hf_decode, hf, prompt, n)[0] for _ in range(args.repeats)])
        co_p = min([await co_prefill(engine, ids) for _ in range(args.repeats)])
    decode, prefill = n / co_d, len(ids) / co_p
    return {
        "length": len(ids),
        "decode_tok_s": decode,
        "hf_decode_tok_s": n / hf_d,
        "prefill_tok_s": prefill,
        "decode_of_quiet": decode / quiet["decode"]["cothink_tok_s"],
        "prefill_of_quiet": prefill / quiet["prefill"][0]["cothink_tok_s"],
    }


def tables(results: dict[str, Any]) -> list[Any]:
    from rich.table import Table

    pre = Table(title="prefill (tokens/s, best of repeats)", title_justify="left")
    # "transformers of limit" bounds any ratio: cothink / transformers <= 1 / that fraction
    for col in ("dtype", "prompt tokens", "cothink", "transformers", "cothink / transformers", "of limit",
                "transformers of limit"):
        pre.add_column(col, justify="left" if col == "dtype" else "right")
    dec = Table(title="decode (tokens/s, greedy, best of repeats)", title_justify="left")
    for col in ("dtype", "prompt + new tokens", "cothink", "transformers", "cothink / transformers",
                "of limit", "transformers of limit", "of linears alone", "vs cothink bf16"):
        dec.add_column(col, justify="left" if col == "dtype" else "right")
    lim = Table(title="limits measured in this run", title_justify="left")
    for col in ("dtype", "GEMV GB/s", "weights MiB", "decode limit tok/s", "linears alone tok/s",
                "GEMM GFLOP/s", "prefill limit tok/s"):
        lim.add_column(col, justify="left" if col == "dtype" else "right")
    con = Table(title="one core busy (another process), cothink", title_justify="left")
    for col in ("dtype", "decode tok/s", "of quiet", "transformers decode", "prefill tok/s", "of quiet"):
        con.add_column(col, justify="left" if col == "dtype" else "right")
    bf16 = results.get("bfloat16", {}).get("decode", {}).get("cothink_tok_s")
    for dtype, res in results.items():
        for row in res["prefill"]:
            pre.add_row(
                dtype,
                str(row["length"]),
                C.fmt(row["cothink_tok_s"]),
                C.fmt(row["hf_tok_s"]),
                f"{row['ratio']:.2f}",
                f"{row['of_limit']:.2f}",
                f"{row['hf_of_limit']:.2f}",
            )
        d = res["decode"]
        dec.add_row(
            dtype,
            f"{d['prompt']} + {d['tokens']}",
            C.fmt(d["cothink_tok_s"]),
            C.fmt(d["hf_tok_s"]),
            f"{d['ratio']:.2f}",
            f"{d['of_limit']:.2f}",
            f"{d['hf_of_limit']:.2f}",
            f"{d['of_linears']:.2f}" if "of_linears" in d else "",
            f"{d['cothink_tok_s'] / bf16:.2f}" if bf16 else "",
        )
        li = res["limits"]
        lim.add_row(
            dtype,
            C.fmt(li["gemv_gb_s"]),
            C.fmt(li["weight_bytes"] / 2**20, 0),
            C.fmt(li["decode_tok_s"]),
            C.fmt(li["linears_decode_tok_s"]) if "linears_decode_tok_s" in li else "",
            C.fmt(li["gemm_gflop_s"], 0),
            C.fmt(li["prefill_tok_s"], 0),
        )
        c = res.get("contention")
        if c:
            con.add_row(
                dtype,
                C.fmt(c["decode_tok_s"]),
                f"{c['decode_of_quiet']:.2f}",
                C.fmt(c["hf_decode_tok_s"]),
                f"{C.fmt(c['prefill_tok_s'])} ({c['length']})",
                f"{c['prefill_of_quiet']:.2f}",
            )
    return [lim, pre, dec] + ([con] if any("contention" in r for r in results.values()) else [])


def plot(results: dict[str, Any], path: Path, title: str) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    colors = {"cothink": "#4C72B0", "transformers": "#DD8452"}
    dtypes = list(results)
    lengths = [r["length"] for r in results[dtypes[0]]["prefill"]]
    width = 0.8 / (2 * len(dtypes))
    for di, dtype in enumerate(dtypes):
        for si, (who, key) in enumerate((("cothink", "cothink_tok_s"), ("transformers", "hf_tok_s"))):
            xs = [i + (2 * di + si - len(dtypes) + 0.5) * width for i in range(len(lengths))]
            ax1.bar(
                xs,
                [r[key] for r in results[dtype]["prefill"]],
                width,
                color=colors[who],
                alpha={"float32": 1.0, "bfloat16": 0.6}.get(dtype, 0.35),
                label=f"{who} {dtype}",
            )
            ax2.bar(
                2 * di + si,
                results[dtype]["decode"][key],
                color=colors[who],
                alpha={"float32": 1.0, "bfloat16": 0.6}.get(dtype, 0.35),
                label=f"{who} {dtype}",
            )
    ax1.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax1.set_xlabel("prompt tokens")
    ax1.set_ylabel("prefill tokens/s")
    ax1.legend(fontsize="small")
    ax1.set_title("prefill")
    ax2.set_xticks(range(2 * len(dtypes)), [f"{w}\n{d}" for d in dtypes for w in ("cothink", "HF")])
    ax2.set_ylabel("decode tokens/s")
    ax2.set_title(f"decode ({results[dtypes[0]]['decode']['tokens']} tokens, greedy)")
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
    console.print(f"[bold]prefill/decode[/bold]: {args.model} on {C.machine_line(info)}")
    t0 = time.perf_counter()
    results = {dtype: asyncio.run(measure_dtype(args, folder, dtype, console)) for dtype in args.dtypes}
    console.print()
    for table in tables(results):
        console.print(table)
    data = {
        "benchmark": "prefill_decode",
        "model": args.model,
        "machine": info,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "results": results,
        "wall_s": time.perf_counter() - t0,
    }
    js = C.write_json(args.out / "prefill_decode.json", data)
    png = plot(
        results,
        args.out / "prefill_decode.png",
        f"cothink vs transformers: {Path(args.model).name}, {info['torch_threads']} threads",
    )
    console.print(f"wrote {js} and {png} ({data['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
