"""Where an engine decode step's time goes, phase by phase: single-stream greedy decode through
`engine.generate` (as prefill_decode.py times it), with timers around the engine's own functions.

    python bench/step_phases.py                      # SmolLM2, bfloat16 and float32
    python bench/step_phases.py --dtypes int8 --model qwen35-random
    python bench/step_phases.py --dtypes int8 --coroutines 32     # 32 coroutines on one context

Per generated token, in ms: on the event-loop thread the scheduler's planning (`schedule`, with
sampling), `prepare` (the step's geometry), `commit` and `postprocess`; on the compute thread the
forward pass, split into the fused decoder layers (one C call, where the model takes it; with the
final norm and the lm_head where every row wants logits and they take the C kernels), the C linears
called outside it (the lm_head of a fused step that does not run it; every linear otherwise) and the
rest (embedding, norms, the torch ops of the per-module path); and what none of these timers saw
(thread hand-offs, the event loop, the stream's consumer). With --coroutines N > 1 the prompt is a
context block that N coroutines read, each generating --tokens in a block of its own, all in the same
steps (bench/peers.py's batch workload): the figures are per step. Each phase's share of the step and the
whole run's tok/s are printed; best of --repeats by total time. The timers wrap module attributes,
so the script runs on older versions of cothink too (A/B runs of one commit against another).
Nothing is asserted; the numbers go to step_phases.json in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import cothink  # noqa: E402  sets the OpenMP wait policy, so it precedes torch
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

# the phases timed (`_targets`: which function each is); "forward" contains the three after it
TIMED = ("schedule", "prepare", "forward", "layers", "linears", "commit", "postprocess")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_common_args(p)
    p.add_argument("--dtypes", nargs="+", choices=list(C.COMPUTE_DTYPES), default=["bfloat16", "float32"])
    p.add_argument("--tokens", type=int, default=None, help="tokens generated per run (default: 64)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens before decoding (default: 128)")
    p.add_argument("--repeats", type=int, default=None, help="runs per dtype, best kept (default: 5)")
    p.add_argument("--coroutines", type=int, default=1,
                   help="coroutines decoding together over the prompt as a shared context (default: 1)")
    args = p.parse_args(argv)
    args.tokens = args.tokens or (8 if args.quick else 64)
    args.repeats = args.repeats or (2 if args.quick else 5)
    return args


def _targets() -> dict[str, tuple[Any, str]]:
    from cothink.execution.runner import ModelRunner
    from cothink.ops import native
    from cothink.scheduler.scheduler import Scheduler

    return {
        "schedule": (Scheduler, "schedule"), "prepare": (ModelRunner, "prepare"),
        "forward": (ModelRunner, "forward"), "layers": (native, "decode_layers"),
        "linears": (native, "linear"), "commit": (ModelRunner, "commit"),
        "postprocess": (Scheduler, "postprocess"),
    }


@contextmanager
def phase_timers(seconds: dict[str, float]) -> Iterator[None]:
    """Add each timed function's wall time to seconds[phase] while the block runs."""
    originals = {}
    for phase, (owner, name) in _targets().items():
        if not hasattr(owner, name):  # an older version without this function
            continue
        originals[phase] = (owner, name, getattr(owner, name))
        setattr(owner, name, _timed(getattr(owner, name), phase, seconds))
    try:
        yield
    finally:
        for owner, name, fn in originals.values():
            setattr(owner, name, fn)


def _timed(fn: Callable[..., Any], phase: str, seconds: dict[str, float]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - start

    return timed


async def decode_run(
    engine: Any, prompt: list[int], n: int, coroutines: int = 1
) -> tuple[float, dict[str, float]]:
    """Prefill (not timed), then n greedy tokens (each of `coroutines` coroutines over the prompt as a
    shared context): (seconds, seconds per phase)."""
    block = engine.block("phases")
    await engine.extend(block, token_ids=prompt)
    own = [engine.block() for _ in range(coroutines)] if coroutines > 1 else []
    views = [[block, b] for b in own] or [block]
    seconds: dict[str, float] = {}
    with phase_timers(seconds):
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(v, max_tokens=n, stop_at_eos=False).collect()
                                         for v in views))
        total = time.perf_counter() - start
    for b in [*own, block]:
        engine.release(b)
    assert all(len(r.token_ids) == n for r in results)
    return total, seconds


def per_token(total: float, seconds: dict[str, float], n: int) -> dict[str, float]:
    """ms per step (one token of each coroutine) of each phase, with the forward's rest and what no
    timer saw."""
    ms = {phase: 1e3 * seconds.get(phase, 0.0) / n for phase in TIMED}
    ms["forward rest"] = ms["forward"] - ms["layers"] - ms["linears"]
    loop_side = ms["schedule"] + ms["prepare"] + ms["commit"] + ms["postprocess"]
    ms["total"] = 1e3 * total / n
    ms["unaccounted"] = ms["total"] - loop_side - ms["forward"]
    return ms


async def measure_dtype(folder: Path, name: str, args: argparse.Namespace) -> dict[str, Any]:
    engine = cothink.Engine.from_pretrained(
        folder, dtype=C.COMPUTE_DTYPES[name], quantize=C.quantize_of(name)
    )
    prompt = C.random_tokens(args.prompt, C.vocab_size(folder), torch.Generator().manual_seed(args.seed))
    async with engine:
        await decode_run(engine, prompt, min(args.tokens, 4), args.coroutines)  # warm-up
        runs = [await decode_run(engine, prompt, args.tokens, args.coroutines) for _ in range(args.repeats)]
    total, seconds = min(runs, key=lambda run: run[0])
    ms = per_token(total, seconds, args.tokens)
    return {"dtype": name, "tok_s": args.coroutines * 1e3 / ms["total"], "ms_per_token": ms}


ROWS = ("schedule", "prepare", "forward", "layers", "linears", "forward rest", "commit", "postprocess",
        "unaccounted", "total")


def show(results: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="engine decode step, ms per step (share of the step)")
    table.add_column("phase")
    for res in results:
        table.add_column(f"{res['dtype']} ({res['tok_s']:.1f} tok/s)", justify="right")
    for row in ROWS:
        label = f"  {row}" if row in ("layers", "linears", "forward rest") else row
        cells = [f"{r['ms_per_token'][row]:.2f} ({r['ms_per_token'][row] / r['ms_per_token']['total']:.0%})"
                 for r in results]
        table.add_row(label, *cells)
    C.console().print(table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info, folder = C.begin(args, "engine step phases")
    results = [asyncio.run(measure_dtype(folder, name, args)) for name in args.dtypes]
    show(results)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    data = {"benchmark": "step_phases", "machine": info, "settings": settings, "results": results}
    C.write_json(args.out / "step_phases.json", data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
