"""Where a step's time goes: torch.profiler over cothink's forward (decode and prefill) next to
transformers' in the same process, same model, dtype and threads.

    python bench/profile_step.py                       # SmolLM2, float32 + bfloat16, 1 thread
    python bench/profile_step.py --dtypes bfloat16 --prefill 512 --threads 2

For each side it prints wall time per step, the time inside torch ops (self CPU time summed), the
number of ops dispatched per step, and the top ops. Wall minus op time is Python and dispatch
overhead. Nothing is asserted; the numbers go to profile_step.json in --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_common_args(p)
    p.add_argument("--dtypes", nargs="+", choices=list(C.DTYPES), default=["float32", "bfloat16"])
    p.add_argument("--prefill", type=int, default=512, help="prefill length (default 512)")
    p.add_argument("--context", type=int, default=128, help="tokens before the decode steps (default 128)")
    p.add_argument("--steps", type=int, default=16, help="decode steps profiled (default 16)")
    p.add_argument("--top", type=int, default=12, help="ops listed per profile")
    p.add_argument("--quantize", default=None, help="cothink weight quantization (int8)")
    args = p.parse_args(argv)
    if args.threads is None:
        args.threads = 1
    return args


def _profile(fn, steps: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm-up
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    plain = (time.perf_counter() - t) / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    events = prof.key_averages()
    # self time of every op (children not double counted); the count is dispatches per step
    op_us = sum(e.self_cpu_time_total for e in events) / steps
    count = sum(e.count for e in events) / steps
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    return {
        "wall_ms": plain * 1e3,
        "op_ms": op_us / 1e3,
        "ops_per_step": count,
        "top": [
            {"op": e.key, "ms": e.self_cpu_time_total / steps / 1e3, "count": e.count / steps}
            for e in top[:40]
        ],
    }


def profile_dtype(args: argparse.Namespace, folder: Path, dtype_name: str) -> dict[str, Any]:
    from transformers import DynamicCache

    from cothink.execution.runner import load_model

    dtype = C.DTYPES[dtype_name]
    vocab = C.vocab_size(folder)
    gen = torch.Generator().manual_seed(args.seed)
    limits: dict[str, Any] = {"kv_tokens": args.prefill + args.context + 4 * args.steps + 256}
    if args.quantize:
        limits["quantize"] = args.quantize
    runner = load_model(folder, dtype=dtype, **limits)
    hf = C.load_hf(folder, dtype)
    context = C.random_tokens(args.context, vocab, gen, low=100)
    prompt = C.random_tokens(args.prefill, vocab, gen, low=100)
    out: dict[str, Any] = {}

    block = runner.new_block("decode")
    runner.extend(block, context, logits="none")
    runner.extend(block, [context[0]], logits="last")  # make sure the decode path is warm
    token = [context[1]]

    def co_decode() -> None:
        runner.extend(block, token, logits="last")

    def co_prefill() -> None:
        b = runner.new_block("prefill")
        runner.extend(b, prompt, logits="last")
        runner.free(b)

    cache = DynamicCache(config=hf.config)
    with torch.inference_mode():
        hf(torch.tensor([context]), past_key_values=cache, use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def hf_decode() -> None:
        hf(torch.tensor([token]), past_key_values=cache, use_cache=True)

    @torch.inference_mode()
    def hf_prefill() -> None:
        cache = DynamicCache(config=hf.config)
        hf(torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)

    out["decode"] = {
        "cothink": _profile(co_decode, args.steps), "transformers": _profile(hf_decode, args.steps)
    }
    out["prefill"] = {"cothink": _profile(co_prefill, 2), "transformers": _profile(hf_prefill, 2)}
    return out


def report(console: Any, dtype: str, res: dict[str, Any], top: int) -> None:
    for phase, sides in res.items():
        co, hf = sides["cothink"], sides["transformers"]
        console.print(
            f"[bold]{dtype} {phase}[/bold]: cothink {co['wall_ms']:.1f} ms/step "
            f"(ops {co['op_ms']:.1f} ms, {co['ops_per_step']:.0f} ops), transformers {hf['wall_ms']:.1f} ms "
            f"(ops {hf['op_ms']:.1f} ms, {hf['ops_per_step']:.0f} ops); "
            f"ratio {hf['wall_ms'] / co['wall_ms']:.2f}"
        )
        for name, side in (("cothink", co), ("transformers", hf)):
            rows = ", ".join(f"{t['op']} {t['ms']:.2f}ms x{t['count']:.0f}" for t in side["top"][:top])
            console.print(f"  {name}: {rows}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    C.setup(args)
    console = C.console()
    folder = C.model_folder(args.model)
    info = C.machine()
    console.print(
        f"profile: {args.model} on {info['cpu']}, {args.threads} threads, "
        f"load {info['load_avg_1min_at_start']}"
    )
    results = {}
    for dtype in args.dtypes:
        # on cothink's compute thread, both sides: one OpenMP pool, as in a process running only cothink
        # (a second thread running parallel ops makes libgomp stop spinning: execution/threads.py)
        results[dtype] = C.on_compute(profile_dtype, args, folder, dtype)
        report(console, dtype, results[dtype], args.top)
    C.write_json(
        args.out / "profile_step.json",
        {
            "benchmark": "profile_step",
            "machine": info,
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
