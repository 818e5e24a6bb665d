"""Where an interactive token's time goes under background load: the steps that carry it, alone and with
N background coroutines.

    python bench/interactive_steps.py --model qwen35-random       # the eval latency suite's hybrid
    python bench/interactive_steps.py --model smollm2 --background 8 --tokens 230

An interactive generation of --tokens tokens after a short prompt, first alone, then while --background
coroutines loop over jobs (extend 32 tokens, generate 32), as the latency suite's background does. From
the engine's step timeline, for the steps that carry the interactive token: their duration by execution
path (``fused``: every decoder layer in one C call; ``native``: per module) and by what they carried,
the event loop's time between consecutive steps (planning, sampling, bookkeeping), and the generation's
inter-token gaps (median, p99), the steps whose forward pass ran on one thread (the engine's
ThreadChooser measuring contention), and the garbage collector's pauses that overlapped them. So the
p99 ratio the latency suite checks (within 2x of alone) splits into what the forward passes cost and
what happens between them. Writes interactive_steps.json to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import cothink  # noqa: E402  sets the OpenMP wait policy, so it precedes torch
import torch  # noqa: E402
from cothink.eval.common import percentile  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_common_args(p)
    p.add_argument("--dtype", choices=sorted(C.DTYPES), default="float32")
    p.add_argument("--background", type=int, default=8, help="background coroutines (default 8)")
    p.add_argument("--tokens", type=int, default=230, help="interactive tokens (default 230: 229 gaps)")
    return p.parse_args(argv)


def _ms(xs: list[float]) -> dict[str, float]:
    """n, p50 and p99 in ms, as the latency suite computes its percentiles."""
    return {"n": len(xs), "p50_ms": 1e3 * percentile(xs, 50), "p99_ms": 1e3 * percentile(xs, 99)}


class _CollectorPauses:
    """The garbage collector's pauses (start, end, generation) while installed."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float, int]] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append((self._started, time.perf_counter(), info["generation"]))

    def within(self, spans: list[tuple[float, float]]) -> list[float]:
        """Durations (s) of the pauses that overlap any of the spans."""
        return [b - a for a, b, _ in self.pauses if any(a < e and b > s for s, e in spans)]


async def _run(engine: Any, background: int, tokens: int) -> dict[str, Any]:
    stop = asyncio.Event()
    pauses = _CollectorPauses()

    # a job adds 64 tokens; a small model's context (the tests' 1024) fills within the warm-up on a fast
    # machine, and a loop that outgrew it would die with InputTooLongError, leaving no background load
    longest = min(2048, engine.max_context - 64)

    async def loop(i: int) -> None:
        block = engine.block(f"bg{i}")
        while not stop.is_set():
            if len(block) > longest:
                engine.truncate(block, 0)
            await engine.extend(block, token_ids=[100 + (7 * i + j) % 900 for j in range(32)], name=f"bg{i}")
            await engine.generate([block], max_tokens=32, stop_at_eos=False, name=f"bg{i}").collect()

    tasks = [asyncio.create_task(loop(i)) for i in range(background)]
    if tasks:
        await asyncio.sleep(0.5)  # the background is running before the interactive request arrives
    ctx, out = engine.block("fg-ctx"), engine.block("fg")
    await engine.extend(ctx, token_ids=list(range(200, 232)))
    first, stamps = engine.steps, []
    gen = engine.generate([ctx, out], max_tokens=tokens, priority="interactive", stop_at_eos=False, name="fg")
    gc.callbacks.append(pauses)
    try:
        async for _ in gen:
            stamps.append(time.perf_counter())
    finally:
        gc.callbacks.remove(pauses)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    steps = [s for s in engine.timeline if s.index > first and any(i.coroutine == "fg" for i in s.items)]
    by_path = {
        path: {**_ms([s.end - s.start for s in steps if s.path == path]),
               "carried": Counter("+".join(sorted(i.kind for i in s.items))
                                  for s in steps if s.path == path).most_common(3)}
        for path in sorted({s.path for s in steps})
    }
    in_steps = pauses.within([(s.start, s.end) for s in steps])
    return {
        "background": background,
        "one_thread_steps": sum(1 for s in steps if s.threads == 1) if torch.get_num_threads() > 1 else 0,
        "collector_pauses_in_steps": {"n": len(in_steps), "max_ms": 1e3 * max(in_steps, default=0.0),
                                      "total_ms": 1e3 * sum(in_steps)},
        "gaps": _ms([b - a for a, b in zip(stamps, stamps[1:])]),
        "steps": _ms([s.end - s.start for s in steps]),
        "between_steps": _ms([b.start - a.end for a, b in zip(steps, steps[1:])]),
        "tokens_per_step": statistics.mean(s.tokens for s in steps) if steps else 0.0,
        "by_path": by_path,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info, folder = C.begin(args, "interactive steps")
    dtype = C.DTYPES[args.dtype]
    runs = []
    for background in (0, args.background):
        engine = cothink.Engine.from_pretrained(folder, dtype=dtype, kv_tokens=32768)

        async def main_(engine=engine, background=background) -> dict[str, Any]:
            async with engine:
                return await _run(engine, background, args.tokens)

        runs.append(asyncio.run(main_()))
    for r in runs:
        g, s, b = r["gaps"], r["steps"], r["between_steps"]
        print(f"{r['background']} background: inter-token p50 {C.fmt(g['p50_ms'], 1)} ms, "
              f"p99 {C.fmt(g['p99_ms'], 1)} ms (n={g['n']}); its steps p50 {C.fmt(s['p50_ms'], 1)} ms, "
              f"p99 {C.fmt(s['p99_ms'], 1)} ms, {C.fmt(r['tokens_per_step'], 2)} tokens; "
              f"between steps p50 {C.fmt(b['p50_ms'], 2)} ms, p99 {C.fmt(b['p99_ms'], 2)} ms")
        gcp = r["collector_pauses_in_steps"]
        print(f"    {r['one_thread_steps']} of its steps on one thread; {gcp['n']} collector pauses inside "
              f"its steps (longest {C.fmt(gcp['max_ms'], 1)} ms, {C.fmt(gcp['total_ms'], 1)} ms in all)")
        for path, d in r["by_path"].items():
            carried = ", ".join(f"{k} x{n}" for k, n in d["carried"])
            print(f"    {path or '-'}: {d['n']} steps, p50 {C.fmt(d['p50_ms'], 1)} ms, "
                  f"p99 {C.fmt(d['p99_ms'], 1)} ms; carrying {carried}")
    alone, loaded = runs[0]["gaps"]["p99_ms"], runs[1]["gaps"]["p99_ms"]
    print(f"inter-token p99 with {args.background} background / alone: {C.fmt(C.ratio(loaded, alone), 2)}x")
    C.write_json(args.out / "interactive_steps.json",
                 {"machine": info, "model": args.model, "dtype": args.dtype, "runs": runs})
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main())
