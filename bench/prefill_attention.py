"""The C prefill attention against torch's flash kernel, one prefill chunk over key runs of growing length.

    python bench/prefill_attention.py            # SmolLM2's heads, bfloat16 and float32, a 512-token
                                                 # chunk over 512 1024 1536 2048 keys (~1 minute)
    python bench/prefill_attention.py --quick    # a 64-token chunk over 64 and 128 keys

A chunk of --chunk query tokens attends causally to a run of L keys whose last --chunk are its own (row
t sees keys 0..L-chunk+t): the runs a long prompt's 512-token prefill chunks read, the first chunk over
512 keys, the fourth over 2048. The model's head layout (query heads, key heads, head size) comes from
--model's config; queries, keys and values are random. Each call is timed both ways, alternating:
`native.prefill_attention` (the native backend's kernel) and ops/attention.py `partial_attention`
(the torch backend's: torch's CPU flash kernel, grouped query heads folded into rows under an explicit
causal mask). Prints ms per call (best of --repeats), the ratio flash / C, the C kernel's rate over the
useful work (4 x visible keys x rows x head size multiply-adds counted once, GFLOP/s), and both
kernels' largest distance from the float64 reference (outputs and log-sum-exps). Writes
prefill_attention.json and prefill_attention.png to --out.
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_common_args(p)
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["bfloat16", "float32"])
    p.add_argument("--chunk", type=int, default=None, help="query tokens (default 512; --quick 64)")
    p.add_argument("--keys", type=int, nargs="+", default=None,
                   help="key run lengths L >= chunk (default: 512 1024 1536 2048; --quick: 64 128)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per kernel (default 10; quick 2)")
    args = p.parse_args(argv)
    q = args.quick
    args.chunk = args.chunk or (64 if q else 512)
    args.keys = args.keys or ([64, 128] if q else [512, 1024, 1536, 2048])
    args.repeats = args.repeats or (2 if q else 10)
    if min(args.keys) < args.chunk:
        p.error(f"--keys must be at least --chunk ({args.chunk}): the chunk's own keys end the run")
    return args


def heads(folder: Path) -> tuple[int, int, int]:
    """(query heads, key heads, head size) of the model's attention layers."""
    from cothink.models.config import load_config

    cfg = load_config(folder)
    return cfg.num_heads, cfg.num_kv_heads, cfg.head_dim


def measure(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            repeats: int) -> dict[str, float]:
    """Both kernels on one chunk, alternating, best of `repeats` each (after one warm-up call)."""
    from cothink.ops import native
    from cothink.ops.attention import partial_attention, reference_partial_attention

    kernels = {"native": native.prefill_attention, "flash": partial_attention}
    want, want_lse = reference_partial_attention(q, k, v, scale, True)
    best = dict.fromkeys(kernels, float("inf"))
    error: dict[str, float] = {}
    for rep in range(1 + repeats):
        for name, kernel in kernels.items():
            seconds, (out, lse) = C.timed(kernel, q, k, v, scale, True)
            if rep:
                best[name] = min(best[name], seconds)
            else:
                error[f"{name}_out_err"] = (out - want).abs().max().item()
                error[f"{name}_lse_err"] = (lse - want_lse).abs().max().item()
    t, hq, d = q.shape
    visible = t * (k.shape[0] - t) + t * (t + 1) / 2  # keys the rows see
    return {
        "keys": k.shape[0],
        "native_ms": best["native"] * 1e3,
        "flash_ms": best["flash"] * 1e3,
        "speedup": best["flash"] / best["native"],
        "native_gflop_s": 4 * visible * hq * d / best["native"] / 1e9,
        **error,
    }


def run_dtype(name: str, shape: tuple[int, int, int], args: argparse.Namespace) -> dict[str, Any]:
    hq, hkv, d = shape
    gen = torch.Generator().manual_seed(args.seed)
    dtype = C.DTYPES[name]
    results = []
    for length in args.keys:
        q = torch.randn(args.chunk, hq, d, generator=gen).to(dtype)
        k, v = (torch.randn(length, hkv, d, generator=gen).to(dtype) for _ in range(2))
        results.append(C.on_compute(measure, q, k, v, d**-0.5, args.repeats))
    return {"dtype": name, "chunk": args.chunk, "heads": list(shape), "results": results}


def show(runs: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="prefill chunk attention: C kernel vs torch's flash kernel "
                        "(ms per call, best of repeats)")
    for col in ("dtype", "chunk", "keys", "C ms", "flash ms", "flash / C", "C GFLOP/s", "C err", "flash err"):
        table.add_column(col, justify="right")
    for run in runs:
        for r in run["results"]:
            table.add_row(run["dtype"], str(run["chunk"]), str(r["keys"]), C.fmt(r["native_ms"], 2),
                          C.fmt(r["flash_ms"], 2), C.fmt(r["speedup"], 2), C.fmt(r["native_gflop_s"], 0),
                          f"{r['native_out_err']:.1e}", f"{r['flash_out_err']:.1e}")
    C.console().print(table)


def main(argv: list[str] | None = None) -> int:
    from cothink.ops import native

    args = parse_args(argv)
    info, folder = C.begin(args, "prefill attention")
    shape = heads(folder)
    for name in args.dtypes:
        probe = torch.zeros(2, shape[0], shape[2], dtype=C.DTYPES[name])
        if not native.prefill_attention_fits(probe, probe[:, : shape[1]], probe[:, : shape[1]]):
            raise SystemExit(f"the C prefill attention does not take {name} here: not built (it needs "
                             "AVX-512 BF16, no AMX tiles) or not this model's heads (a head size that is a "
                             "multiple of 16)")
    runs = [run_dtype(name, shape, args) for name in args.dtypes]
    show(runs)
    C.write_speedups(args, info, "prefill_attention", runs, "keys",
                     title=f"{args.model} prefill attention ({args.chunk}-token chunk) on {info['cpu']}",
                     xlabel="keys in the run (the chunk's own last)", ylabel="flash time / C kernel time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
