"""Does torch.compile speed up cothink's decode step here? Eager vs inductor, same process and threads.

    python bench/compile_probe.py            # SmolLM2 bfloat16, 1 and 2 threads (~3 minutes)
    python bench/compile_probe.py --quick    # fewer steps

The whole decoder forward (embedding, every layer, final norm, lm_head) is compiled as one graph with
`torch.compile(dynamic=True)`; the view attention (Python over blocks and key runs) and the bfloat16
oneDNN-prepacked linears (opaque weight tensors inductor cannot trace) enter the graph as opaque
custom ops, so inductor fuses everything between them (norms, residuals, SiLU x up, casts). Single
greedy decode steps through `ModelRunner` on the compute thread, eager and compiled alternating,
best of --repeats. A probe, not a cothink option: it needs a C++ compiler (inductor's CPU codegen)
and covers attention-only families (Llama, Qwen3). It measures the torch path: cothink's own fused C
kernels (cothink.ops.native, which dynamo cannot trace) are switched off on both sides. Writes
compile_probe.json to --out.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import cothink  # noqa: F401,E402  sets the OpenMP wait policy, so it precedes torch
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from cothink.execution.runner import ModelRunner, load_model  # noqa: E402
from cothink.execution.threads import run_compute, use_threads  # noqa: E402
from cothink.models.packing import PackedLinear  # noqa: E402
from cothink.models.transformer import CausalLM  # noqa: E402
from cothink.ops import native  # noqa: E402

_STEP_CONTEXT: list[Any] = [None]  # the ViewBatch of the step being run (the attention op reads it)
_PACKED: list[PackedLinear] = []  # the prepacked linears, by handle


@torch.library.custom_op("cothink_probe::view_attention", mutates_args=())
def _view_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return _STEP_CONTEXT[0].attention(layer, q, k, v)


@_view_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q, dtype=torch.float32)


@torch.library.custom_op("cothink_probe::packed_linear", mutates_args=())
def _packed_linear(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    return _PACKED[int(handle[0])].forward(x)


@_packed_linear.register_fake
def _(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], handle.shape[0])  # the handle's length is the output width


class _OpaqueLinear(torch.nn.Module):
    """A PackedLinear seen by the compiler as one opaque op."""

    def __init__(self, inner: PackedLinear):
        super().__init__()
        _PACKED.append(inner)
        self.register_buffer("handle", torch.full((inner.out_features,), len(_PACKED) - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_linear(x, self.handle)


class _OpaqueContext:
    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _view_attention(q, k, v, layer)


def _decoder(model: CausalLM, input_ids: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:
    return CausalLM.forward(model, input_ids, _OpaqueContext(), logit_rows)


class CompiledForward:
    """Swaps a runner's model forward between eager and one compiled graph (`compiled` flag)."""

    def __init__(self, runner: ModelRunner):
        self.model, self.compiled = runner.model, False
        self.graph_model = _opaque_copy(runner.model)
        self.graph = torch.compile(_decoder, dynamic=True)
        self.eager = type(self.model).forward
        self.model.forward = self.forward  # instance attribute: only this model

    def forward(
        self, input_ids: torch.Tensor, ctx: Any, logit_rows: torch.Tensor, layers: Any = None,
        vision: Any = None, to_logits: Any = None,
    ) -> torch.Tensor:
        # `layers` and `to_logits` (the fused decode step) and `vision` are None here: the probe runs
        # text-only steps with the C kernels off
        if not self.compiled or logit_rows.numel() == 0:
            return self.eager(self.model, input_ids, ctx, logit_rows, layers, vision, to_logits)
        _STEP_CONTEXT[0] = ctx
        try:
            return self.graph(self.graph_model, input_ids, logit_rows)
        finally:
            _STEP_CONTEXT[0] = None


def _opaque_copy(module: torch.nn.Module | None) -> torch.nn.Module | None:
    """A shallow stand-in sharing the weights, with every PackedLinear wrapped as an opaque op."""
    if module is None:  # an optional submodule left unset (e.g. no q/k norm)
        return None
    if isinstance(module, PackedLinear):
        return _OpaqueLinear(module)
    twin = copy.copy(module)
    twin._modules = {name: _opaque_copy(child) for name, child in module._modules.items()}
    return twin


def decode_ms(runner: ModelRunner, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    """Greedy single-token steps after `prompt`: (ms per step, tokens)."""
    block = runner.new_block("probe")
    logits = runner.extend(block, prompt, logits="last")
    tokens = []
    start = time.perf_counter()
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits = runner.extend(block, [tokens[-1]], logits="last")
    ms = (time.perf_counter() - start) / steps * 1e3
    runner.free(block)
    return ms, tokens


def measure(runner: ModelRunner, probe: CompiledForward, threads: int, args: argparse.Namespace) -> dict:
    use_threads(threads)
    prompt = list(range(100, 100 + args.prompt))
    best = {"eager": float("inf"), "compiled": float("inf")}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.repeats):
        for mode in best:
            probe.compiled = mode == "compiled"
            ms, tokens[mode] = decode_ms(runner, prompt, args.steps)
            best[mode] = min(best[mode], ms)
    return {
        "threads": threads,
        "eager_ms": best["eager"],
        "compiled_ms": best["compiled"],
        "speedup": best["eager"] / best["compiled"],
        "same_tokens": tokens["eager"] == tokens["compiled"],
    }


def run(args: argparse.Namespace, console: Any) -> dict[str, Any]:
    was, native.ENABLED = native.ENABLED, False  # the torch path, eager and compiled (COTHINK_NATIVE=0)
    try:
        return _probe(args, console)
    finally:
        native.ENABLED = was


def _probe(args: argparse.Namespace, console: Any) -> dict[str, Any]:
    dtype = C.DTYPES[args.dtype]
    runner = load_model(C.model_folder(args.model), dtype=dtype)
    if runner.config.linear_layers:
        raise SystemExit("compile_probe covers attention-only models (Llama, Qwen3)")
    # on the compute thread: a parallel torch op on this thread (filling the handles) would start a
    # second OpenMP pool and make libgomp stop spinning for both sides (execution/threads.py)
    probe = run_compute(CompiledForward, runner)
    probe.compiled = True
    start = time.perf_counter()
    run_compute(decode_ms, runner, list(range(100, 100 + args.prompt)), 2)  # compiles (T=1 graph)
    compile_s = time.perf_counter() - start
    console.print(f"  compiled the decoder in {compile_s:.1f}s")
    rows = []
    for threads in args.threads_list:
        row = run_compute(measure, runner, probe, threads, args)
        rows.append(row)
        console.print(
            f"  {threads} thread(s): eager {row['eager_ms']:.2f} ms/step, compiled {row['compiled_ms']:.2f} "
            f"ms/step, eager / compiled {row['speedup']:.2f}, same greedy tokens: {row['same_tokens']}"
        )
    return {"dtype": args.dtype, "compile_s": compile_s, "rows": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_common_args(p)
    p.add_argument("--dtype", choices=list(C.DTYPES), default="bfloat16")
    p.add_argument("--threads-list", type=int, nargs="+", default=[1, 2], help="thread counts (default 1 2)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens before decoding (default 128)")
    p.add_argument("--steps", type=int, default=None, help="decode steps per run (default 64; quick 16)")
    p.add_argument("--repeats", type=int, default=None, help="runs per mode (default 3; quick 2)")
    args = p.parse_args(argv)
    args.steps = args.steps or (16 if args.quick else 64)
    args.repeats = args.repeats or (2 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    C.setup(args)
    console = C.console()
    if shutil.which("g++") is None and shutil.which("c++") is None:
        console.print("compile_probe needs a C++ compiler for inductor's CPU code; none found")
        return 2
    machine = C.machine()
    console.print(
        f"compile probe: {args.model} {args.dtype} on {machine['cpu']}, {machine['cores']} CPUs, "
        f"torch {machine['torch']} (load avg {machine['load_avg_1min_at_start']})"
    )
    start = time.perf_counter()
    results = run(args, console)
    path = C.write_json(args.out / "compile_probe.json", {"machine": machine, "results": results})
    console.print(f"wrote {path} ({time.perf_counter() - start:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
