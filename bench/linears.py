"""The fast path's CPU linears against plain `F.linear`, by the number of rows, on a model's weights.

    python bench/linears.py            # SmolLM2, float32 and bfloat16, rows 1 .. 512 (~2 minutes)
    python bench/linears.py --quick    # rows 1 4 16 64
    python bench/linears.py --dtypes int8 int4 --rows 1 8 32 512    # the quantized weights

For each dtype the model is loaded through cothink (fast path), and every linear layer one forward pass
calls (all layers and the lm_head: more bytes than the caches hold, as in a real step) runs on a
random input of M rows, back to back: once through the module the fast path installed
(models/packing.py: `CpuLinear`, or `PackedLinear` where oneDNN has bfloat16 kernels) and once
through an `nn.Linear` (`F.linear`) on the same dense weight: the same module call around a different
kernel. int8 and int4 (weight-only quantization, bfloat16 activations) run their quantized modules
against `F.linear` on the dequantized bfloat16 weight, what the model would multiply unquantized.
Each is the best of --repeats passes, alternating.
Prints ms per pass, weight GB/s (each side's own weight bytes / time: the quantized weights and their
scales on the fast path) and GFLOP/s, and the ratio; this is the measurement behind the row
thresholds in models/packing.py. Writes linears.json and linears.png to --out.
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
    p.add_argument("--dtypes", nargs="+", choices=list(C.COMPUTE_DTYPES), default=["float32", "bfloat16"])
    p.add_argument("--rows", type=int, nargs="+", default=None,
                   help="input rows M (default: 1 2 4 8 16 32 64 128 512; --quick: 1 4 16 64)")
    p.add_argument("--repeats", type=int, default=None, help="passes per measurement (default 5; quick 3)")
    args = p.parse_args(argv)
    args.rows = args.rows or ([1, 4, 16, 64] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128, 512])
    args.repeats = args.repeats or (3 if args.quick else 5)
    return args


def dense_weight(module: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The plain [out, in] weight of a fast-path linear (a prepacked one unpacked, a quantized one
    dequantized to `dtype`)."""
    if hasattr(module, "dequantized"):  # int8
        return module.dequantized(dtype)
    if hasattr(module, "weight_packed"):  # 4-bit
        return module.weights.dequantize().to(dtype)
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else module.dense_weight()


def stored_bytes(module: torch.nn.Module, dense: torch.Tensor) -> int:
    """Bytes of weight a fast-path module reads: a quantized one's codes and scales (as its kernel takes
    them), else the dense weight's."""
    if hasattr(module, "dequantized") or hasattr(module, "weight_packed"):
        weight, scale, _ = module.operands()
        return sum(t.numel() * t.element_size() for t in (weight, scale) if t is not None)
    return dense.numel() * dense.element_size()


def fast_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The linear layers a forward pass calls: fused projections and the lm_head, each once."""
    from cothink.models.packing import drop_fused_parts

    drop_fused_parts(model)  # the HF-named parts are views of the fused weights, not called
    return [m for m in model.modules() if hasattr(m, "in_features") and not list(m.children())]


def plain_linear(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Linear:
    """An nn.Linear (F.linear behind the same module call) on the fast-path module's dense weight."""
    weight = dense_weight(module, dtype)
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return linear


def measure(modules: list[torch.nn.Module], rows: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    plains = [plain_linear(m, dtype) for m in modules]
    weights = [p.weight for p in plains]
    stored = sum(stored_bytes(m, w) for m, w in zip(modules, weights))
    inputs = {m.in_features: torch.randn(rows, m.in_features).to(dtype) for m in modules}

    def fast() -> None:
        for m in modules:
            m(inputs[m.in_features])

    def plain() -> None:
        for m in plains:
            m(inputs[m.in_features])

    best = {"fast": float("inf"), "plain": float("inf")}
    with torch.inference_mode():
        fast(), plain()  # warm-up
        for _ in range(repeats):
            for name, fn in (("fast", fast), ("plain", plain)):
                seconds, _ = C.timed(fn)
                best[name] = min(best[name], seconds)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flops = 2 * rows * sum(w.numel() for w in weights)
    return {
        "rows": rows,
        "fast_ms": best["fast"] * 1e3,
        "plain_ms": best["plain"] * 1e3,
        "fast_gb_s": stored / best["fast"] / 1e9,
        "plain_gb_s": nbytes / best["plain"] / 1e9,
        "fast_gflop_s": flops / best["fast"] / 1e9,
        "plain_gflop_s": flops / best["plain"] / 1e9,
        "speedup": best["plain"] / best["fast"],
    }


def run_dtype(folder: Path, name: str, args: argparse.Namespace) -> dict[str, Any]:
    from cothink.execution.runner import load_model

    dtype = C.COMPUTE_DTYPES[name]
    runner = load_model(folder, dtype=dtype, quantize=C.quantize_of(name))
    modules = fast_linears(runner.model)
    kinds = sorted({type(m).__name__ for m in modules})
    results = [C.on_compute(measure, modules, m, dtype, args.repeats) for m in args.rows]
    return {"dtype": name, "modules": len(modules), "module_kinds": kinds, "results": results}


def show(runs: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="fast-path linears vs F.linear, one forward pass's weights (best of repeats)")
    for col in ("dtype", "rows", "fast path ms", "F.linear ms", "fast GB/s", "F.linear GB/s",
                "fast GFLOP/s", "F.linear GFLOP/s", "speedup"):
        table.add_column(col, justify="right")
    for run in runs:
        for r in run["results"]:
            table.add_row(run["dtype"], str(r["rows"]), C.fmt(r["fast_ms"], 2), C.fmt(r["plain_ms"], 2),
                          C.fmt(r["fast_gb_s"]), C.fmt(r["plain_gb_s"]), C.fmt(r["fast_gflop_s"]),
                          C.fmt(r["plain_gflop_s"]), C.fmt(r["speedup"], 2))
    C.console().print(table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info, folder = C.begin(args, "linears")
    runs = [run_dtype(folder, name, args) for name in args.dtypes]
    for run in runs:
        print(f"{run['dtype']}: {run['modules']} linears per pass through {', '.join(run['module_kinds'])}")
    show(runs)
    C.write_speedups(args, info, "linears", runs, "rows",
                     title=f"{args.model} linears on {info['cpu']}",
                     xlabel="rows per call (M)", ylabel="F.linear time / fast path time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
