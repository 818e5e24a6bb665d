"""The fused C decode attention against the torch kernels, in whole decode steps, by context and readers.

    python bench/decode_attention.py            # SmolLM2 bfloat16 and float32, contexts 256 1024 2048,
                                                # N = 1 2 4 8 coroutines (~4 minutes)
    python bench/decode_attention.py --quick    # context 128, N = 1 2

N coroutines share a context of L tokens (one block, prefilled once); each decodes one token per step
over [context, its own block], so a step reads about N x L keys per query head. With --private each
coroutine reads a context of its own instead (N blocks of L tokens: as many distinct keys as reads).
Every step runs the same model twice, alternating: with the "native" backend's fused kernel at any size
(`NATIVE_DECODE_MAX_KEYS` and `NATIVE_DECODE_MAX_SHARING` lifted; steps of up to 32 rows then run as
the fused decode step, execution/fused_decode.py, as they do in use) and with the torch kernels (the
limits set to 0: CPU flash attention per shared run, a padded batch for the own runs, LSE merges).
Each is the best of --repeats timed groups of --steps steps. Prints ms per step and the ratio torch /
native; this is the measurement behind `NATIVE_DECODE_MAX_KEYS` and `NATIVE_DECODE_MAX_SHARING`
(execution/attention_backends.py). Writes
decode_attention.json and decode_attention.png to --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import cothink  # noqa: E402,F401  sets the OpenMP wait policy, so it precedes torch
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

OWN_TOKENS = 4  # each coroutine's own block before it decodes
UNLIMITED = 1 << 40


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_common_args(p)
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["bfloat16", "float32"])
    p.add_argument("--contexts", type=int, nargs="+", default=None,
                   help="shared context tokens L (default: 256 1024 2048; --quick: 128)")
    p.add_argument("--coroutines", type=int, nargs="+", default=None,
                   help="coroutines N reading the context (default: 1 2 4 8; --quick: 1 2)")
    p.add_argument("--steps", type=int, default=None,
                   help="decode steps per timed group (default 4; quick 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed groups per kernel (default 3; quick 1)")
    p.add_argument("--private", action="store_true",
                   help="each coroutine reads a context of its own (default: one shared context)")
    args = p.parse_args(argv)
    q = args.quick
    args.contexts = args.contexts or ([128] if q else [256, 1024, 2048])
    args.coroutines = args.coroutines or ([1, 2] if q else [1, 2, 4, 8])
    args.steps = args.steps or (2 if q else 4)
    args.repeats = args.repeats or (1 if q else 3)
    return args


def kv_tokens(args: argparse.Namespace) -> int:
    """Pool slots for the largest context and its readers' blocks (each freed after its measurement),
    with a page of rounding per block."""
    per_block = OWN_TOKENS + 2 * (1 + args.repeats) * args.steps + 64  # both kernels' steps, a page
    contexts = max(args.coroutines) if args.private else 1
    return contexts * (max(args.contexts) + 64) + max(args.coroutines) * per_block


def measure(runner: Any, contexts: list[Any], args: argparse.Namespace) -> dict[str, float]:
    """Decode steps of one coroutine per context block in `contexts` (the same block n times: shared)."""
    from cothink.execution import attention_backends
    from cothink.execution.step import StepItem

    n = len(contexts)
    own = [runner.new_block() for _ in range(n)]
    runner.step([StepItem(b, [7 + i] * OWN_TOKENS, view=[c, b], logits="none")
                 for i, (c, b) in enumerate(zip(contexts, own))])

    def steps() -> None:
        for _ in range(args.steps):
            runner.step([StepItem(b, [5], view=[c, b], logits="last") for c, b in zip(contexts, own)])

    best = {"native": float("inf"), "torch": float("inf")}
    limits = {"torch": 0, "native": UNLIMITED}
    saved = attention_backends.NATIVE_DECODE_MAX_KEYS, attention_backends.NATIVE_DECODE_MAX_SHARING
    try:
        for rep in range(1 + args.repeats):  # the first round warms both up
            for name, limit in limits.items():
                attention_backends.NATIVE_DECODE_MAX_KEYS = limit
                attention_backends.NATIVE_DECODE_MAX_SHARING = limit
                seconds, _ = C.timed(steps)
                if rep:
                    best[name] = min(best[name], seconds / args.steps)
    finally:
        attention_backends.NATIVE_DECODE_MAX_KEYS, attention_backends.NATIVE_DECODE_MAX_SHARING = saved
        for block in own:
            runner.free(block)
    return {
        "context": contexts[0].length,
        "coroutines": n,
        "private": len({id(c) for c in contexts}) > 1,
        "keys_per_step": n * (contexts[0].length + OWN_TOKENS),  # at the first step (one more per step after)
        "native_ms": best["native"] * 1e3,
        "torch_ms": best["torch"] * 1e3,
        "speedup": best["torch"] / best["native"],
    }


def run_dtype(folder: Path, name: str, args: argparse.Namespace) -> dict[str, Any]:
    from cothink.execution.runner import load_model
    from cothink.ops import native

    if not native.available():
        raise SystemExit("cothink's C kernels are off or did not build here: nothing to compare")
    runner = load_model(folder, dtype=C.DTYPES[name], attention_backend="native", kv_tokens=kv_tokens(args))
    if runner.config.head_dim % 16:
        raise SystemExit(f"head size {runner.config.head_dim}: the fused kernel reads multiples of 16")
    vocab = C.vocab_size(folder)
    gen = torch.Generator().manual_seed(args.seed)
    results = []
    for length in args.contexts:
        for n in args.coroutines:
            blocks = [runner.new_block() for _ in range(n if args.private else 1)]
            for block in blocks:
                runner.extend(block, C.random_tokens(length, vocab, gen), logits="none")
            contexts = blocks if args.private else blocks * n
            results.append(C.on_compute(measure, runner, contexts, args))
            for block in blocks:
                runner.free(block)
    return {"dtype": name, "results": results}


def show(runs: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="decode step ms: fused C attention vs torch kernels (best of repeats)")
    for col in ("dtype", "context", "N", "keys per step", "native ms", "torch ms", "torch / native"):
        table.add_column(col, justify="right")
    for run in runs:
        for r in run["results"]:
            table.add_row(run["dtype"], str(r["context"]), str(r["coroutines"]), C.fmt(r["keys_per_step"], 0),
                          C.fmt(r["native_ms"], 2), C.fmt(r["torch_ms"], 2), C.fmt(r["speedup"], 2))
    C.console().print(table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info, folder = C.begin(args, "decode attention")
    runs = [run_dtype(folder, name, args) for name in args.dtypes]
    show(runs)
    C.write_speedups(args, info, "decode_attention", runs, "keys_per_step",
                     title=f"{args.model} decode attention on {info['cpu']}",
                     xlabel="keys read per step (N x context)", ylabel="torch step time / native step time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
