"""Shared helpers for the benchmarks: models, timing, cache sizes, output files.

The benchmarks are scripts (``python bench/prefill_decode.py``); this module sits next to them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from cothink.ops import native

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results"


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="smollm2",
        help="embedded model name, qwen35-random (the eval suite's random Qwen3.5 hybrid), "
        f"one of {sorted(FAMILY_RANDOM)} (small random MoE / Kimi Linear checkpoints, built once) "
        "or a local Hugging Face folder (default: smollm2)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for both cothink and transformers (default: torch's default)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true", help="a ~1 minute run with smaller settings")
    p.add_argument("--seed", type=int, default=0)


def setup(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    _quiet_transformers()


def _quiet_transformers() -> None:
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")


def console() -> Any:
    """A rich console; 150 columns wide when the output is not a terminal (logs, files)."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=150)


def _run_info() -> dict[str, Any]:
    """cothink.run_info's record: commit, dirty flag, CPU model, cores, torch and its threads, Python, start
    time. A cothink older than that module (an A/B run against an older commit) gets this checkout's copy,
    which still names the commit of the cothink imported."""
    try:
        from cothink.run_info import run_info
    except ImportError:
        import importlib.util

        spec = importlib.util.spec_from_file_location("_run_info", ROOT / "src" / "cothink" / "run_info.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        run_info = module.run_info
    return run_info().as_dict()


def machine() -> dict[str, Any]:
    """What the numbers were measured on, and at which commit."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover
        load = float("nan")
    return {
        **_run_info(),
        "platform": platform.platform(),
        # cothink's fused C kernels (cothink.ops.native), or the torch path (COTHINK_NATIVE=0 / no compiler)
        "cothink_kernels": "native" if native.available() else "torch",
        "load_avg_1min_at_start": round(load, 2),
    }


def machine_line(info: dict[str, Any]) -> str:
    """The CPU, threads and load a result was measured under, for the first line a script prints."""
    return (f"{info['cpu']}, {info['cores']} CPUs, torch {info['torch']} with "
            f"{info['torch_threads']} threads (load avg {info['load_avg_1min_at_start']})")


def begin(args: argparse.Namespace, what: str) -> tuple[dict[str, Any], Path]:
    """A script's start: `setup`, the line "<what>: <model> on <machine_line>", and the model folder."""
    setup(args)
    info = machine()
    print(f"{what}: {args.model} on {machine_line(info)}")
    return info, model_folder(args.model)


def model_folder(model: str) -> Path:
    """An embedded name, "qwen35-random" (the eval suite's random Qwen3.5 hybrid, built once) or a folder."""
    from cothink.models.hub import resolve_model_path

    if model == "qwen35-random":
        from cothink.eval.models import build_qwen35_random

        return build_qwen35_random()
    if model in FAMILY_RANDOM:
        return build_family_random(model)
    return Path(resolve_model_path(model))


# Small random checkpoints of the MoE and Kimi Linear families (fp32 weights; the shapes keep each
# family's structure: hybrid layer patterns, 16 experts with top 4 and a shared expert, Kimi's dense
# first layer, KDA + MLA). For running the benchmarks on these code paths, not for speed claims about
# the released models.
_LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
_QWEN_MOE = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, layer_types=_LAYERS,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                 linear_conv_kernel_dim=4, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                 num_experts=16, num_experts_per_tok=4, max_position_embeddings=32768, initializer_range=0.05,
                 tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
FAMILY_RANDOM: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen35-moe-random": ("Qwen3_5Moe", _QWEN_MOE),
    "qwen3-next-random": ("Qwen3Next", _QWEN_MOE | dict(intermediate_size=512, decoder_sparse_step=1,
                                                        mlp_only_layers=[], norm_topk_prob=True)),
    "kimi-random": ("KimiLinear", dict(
        vocab_size=4096, hidden_size=256, num_hidden_layers=4, layer_types=_LAYERS,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=128, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
        linear_head_dim=64, linear_num_heads=4, linear_conv_kernel_dim=4, intermediate_size=512,
        moe_intermediate_size=128, num_local_experts=16, num_experts_per_tok=4, n_shared_experts=1,
        n_group=1, topk_group=1, routed_scaling_factor=2.446, rms_norm_eps=1e-5, initializer_range=0.05,
        max_position_embeddings=32768, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
        pad_token_id=None)),
}


@torch.no_grad()
def build_family_random(name: str) -> Path:
    """Build (once, under the cothink cache) and return the folder of FAMILY_RANDOM[name]."""
    import shutil

    import transformers as tf

    from cothink.models.hub import cache_dir

    prefix, shape = FAMILY_RANDOM[name]
    folder = cache_dir() / "bench" / name
    marker = folder / "cothink_bench_model.json"
    if marker.exists() and json.loads(marker.read_text()) == shape:
        return folder
    config_cls = getattr(tf, f"{prefix}TextConfig", None) or getattr(tf, f"{prefix}Config")
    torch.manual_seed(0)
    model = getattr(tf, f"{prefix}ForCausalLM")(config_cls(**shape)).eval()
    gen = torch.Generator().manual_seed(1)
    for param_name, param in model.named_parameters():  # norms and biases off their trivial init
        if param_name.endswith("A_log"):
            param.copy_(torch.empty(param.shape).uniform_(0.02, 0.3, generator=gen).log())
        elif "norm" in param_name or param_name.endswith("bias"):
            param.add_(0.1 * torch.randn(param.shape, generator=gen))
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    (tmp / "cothink_bench_model.json").write_text(json.dumps(shape))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def on_compute(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a transformers measurement on cothink's compute thread, the thread the engine's forward
    passes run on: both sides then share one OpenMP pool, as a process that only runs cothink does
    (a second thread running multi-threaded torch makes libgomp stop spinning for everyone; see
    cothink/execution/threads.py). Older cothink versions (A/B runs) have no such thread."""
    try:
        from cothink.execution.threads import run_compute
    except ImportError:
        return fn(*args, **kwargs)
    return run_compute(fn, *args, **kwargs)  # with this thread's torch thread count (--threads)


def load_hf(folder: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    return model.eval()


def vocab_size(folder: Path) -> int:
    cfg = json.loads((folder / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size"))


def random_tokens(n: int, vocab: int, gen: torch.Generator, low: int = 0) -> list[int]:
    """n token ids drawn uniformly from [low, vocab) (low skips a model's special tokens)."""
    low = min(low, vocab // 2)
    return torch.randint(low, vocab, (n,), generator=gen).tolist()


def cache_bytes(cache: Any) -> int:
    """Bytes of K/V held by a transformers cache (DynamicCache in transformers 4.x and 5.x)."""
    total = 0
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total
    for name in ("key_cache", "value_cache"):  # older transformers
        for t in getattr(cache, name, []):
            total += t.numel() * t.element_size()
    return total


def timed(fn, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t, out


def write_json(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(json.dumps(data, indent=2, default=str))
    return path


def ratio_plot(series: dict[str, list[tuple[float, float]]], path: Path, *, title: str, xlabel: str,
               ylabel: str) -> Path:
    """One line per series of (x, ratio) points on a log2 x axis, with the 1.0 line; written to `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for label, points in series.items():
        points = sorted(points)
        ax.plot([x for x, _ in points], [y for _, y in points], "o-", label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def write_speedups(args: argparse.Namespace, info: dict[str, Any], stem: str, runs: list[dict[str, Any]],
                   x_key: str, *, title: str, xlabel: str, ylabel: str) -> None:
    """Write `stem`.json (machine, model, runs) and `stem`.png (each run's "speedup" by `x_key`, one
    line per dtype) to --out, and say where."""
    json_path = write_json(args.out / f"{stem}.json", {"machine": info, "model": args.model, "runs": runs})
    series = {run["dtype"]: [(r[x_key], r["speedup"]) for r in run["results"]] for run in runs}
    png = ratio_plot(series, args.out / f"{stem}.png", title=title, xlabel=xlabel, ylabel=ylabel)
    print(f"wrote {json_path} and {png}")


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def fmt(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"


# ------------------------------------------------------------------------------------- machine limits

# "int8" / "int4" run cothink with weight-only int8 / 4-bit linears (bfloat16 activations) against
# transformers bf16
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.bfloat16,
                  "int4": torch.bfloat16}


def quantize_of(dtype_name: str) -> str | None:
    return dtype_name if dtype_name in ("int8", "int4") else None


def _linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def linear_parameters(model: torch.nn.Module) -> int:
    """Parameters of the linear layers (lm_head included): 2 x this is a token's matmul FLOPs."""
    return sum(m.weight.numel() for m in _linears(model))


def streamed_weight_bytes(model: torch.nn.Module, dtype_name: str) -> int:
    """Bytes of weights one decode step reads: every linear (lm_head included; the embedding lookup
    reads one row). "int8": one byte per weight plus a bfloat16 scale per output row. "int4": half a
    byte per weight plus a float32 scale and offset per 32 (models/quant4.py), the lm_head int8."""
    if dtype_name == "int8":
        return sum(m.weight.numel() + 2 * m.weight.shape[0] for m in _linears(model))
    if dtype_name == "int4":
        head = getattr(model, "lm_head", None)
        return sum(m.weight.numel() + 2 * m.weight.shape[0] if m is head else m.weight.numel() // 2
                   + m.weight.numel() // 32 * 8 for m in _linears(model))
    elsize = torch.tensor([], dtype=DTYPES[dtype_name]).element_size()
    return linear_parameters(model) * elsize


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def stream_gb_s(threads: int, mib: int = 256) -> float:
    """How fast this machine reads a weight larger than the caches, on `threads` threads (GB/s): the
    fastest of torch's sum over `mib` MiB of float32 and of bfloat16 and, where cothink's C kernels
    run, its one-row product over `mib` MiB of bfloat16 weights (in its pairs layout where it has
    one). The weight-streaming limit of a decode step that reads every weight once."""
    from cothink.ops import native

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = 0.0
        for dtype in (torch.float32, torch.bfloat16):
            size = torch.tensor([], dtype=dtype).element_size()
            w = torch.randn(mib * 2**20 // (2048 * size), 2048).to(dtype)
            best = max(best, w.nbytes / _best(w.sum, 8) / 1e9)
            if dtype == torch.bfloat16 and native.available():
                x = torch.randn(1, 2048).to(dtype)
                packed = native.pack_pairs(w) if native.takes_pairs(w) else w
                best = max(best, w.nbytes / _best(lambda: native.linear(x, packed, None), 8) / 1e9)
            del w
        return best
    finally:
        torch.set_num_threads(before)


def measure_limits(dtype: torch.dtype, threads: int, quick: bool) -> dict[str, float]:
    """This machine's limits, measured now with torch itself: GEMV bandwidth (a [1, K] x [K, N]
    matmul over a weight larger than the caches: bytes / time) and GEMM throughput (GFLOP/s), each
    the best of `F.linear` and the kernel cothink's fast path has for the dtype on this CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        k = 2048
        elsize = torch.tensor([], dtype=dtype).element_size()
        n = (64 if quick else 256) * 2**20 // (k * elsize)
        w = torch.randn(n, k).to(dtype)
        x = torch.randn(1, k).to(dtype)
        m = 256 if quick else 512
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, k).to(dtype)
        with torch.inference_mode():
            gemv_s = _best(lambda: torch.nn.functional.linear(x, w), 3 if quick else 8)
            gemm_s = _best(lambda: torch.nn.functional.linear(a, b), 2 if quick else 4)
            # the fastest way this machine multiplies by weights of this dtype sets the limit
            if _packable(dtype):
                wp, bp = (torch.ops.mkldnn._reorder_linear_weight(t) for t in (w, b))
                gemv_s = min(gemv_s, _best(lambda: _packed(x, wp), 3 if quick else 8))
                gemm_s = min(gemm_s, _best(lambda: _packed(a, bp), 2 if quick else 4))
            elif dtype == torch.bfloat16:  # bfloat16 weights widened to float32 slab by slab
                from cothink.models.packing import CpuLinear

                widened = CpuLinear(b, None)
                gemm_s = min(gemm_s, _best(lambda: widened(a), 2 if quick else 4))
        return {"gemv_gb_s": n * k * elsize / gemv_s / 1e9, "gemm_gflop_s": 2 * m * k * k / gemm_s / 1e9}
    finally:
        torch.set_num_threads(before)


class LinearCalls:
    """The linear layers a runner's forward passes call, in call order with their input rows,
    recorded by forward hooks while `with LinearCalls(runner) as calls:` runs real steps (through
    the per-module path: the fused decode step, which calls the same kernels from C, is off
    meanwhile, and the head's `float_forward` goes through its module call, where hooks see it).

    Replaying one pass's calls alone (`seconds`) times that step's matmuls with nothing around them,
    through the same modules and kernels: a bound on the step for any engine built on those kernels,
    tighter than the GEMV limit when layer-sized matrices stream slower than one big one."""

    def __init__(self, runner: Any):
        self.runner, self.model = runner, runner.model
        self.passes: list[list[tuple[torch.nn.Module, int]]] = []

    def __enter__(self) -> LinearCalls:
        leaves = [m for m in self.model.modules() if hasattr(m, "in_features") and not list(m.children())]
        self._hooks = [self.model.register_forward_pre_hook(lambda *_: self.passes.append([]))]
        self._hooks += [m.register_forward_hook(self._record) for m in leaves]
        self._fused, self.runner.fused_decode = self.runner.fused_decode, None
        self._float_heads = [m for m in leaves if hasattr(m, "float_forward")]
        for m in self._float_heads:  # an instance attribute over the method, removed on exit
            m.float_forward = lambda x, m=m: m(x).float()
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        for m in self._float_heads:
            del m.float_forward
        self.runner.fused_decode = self._fused

    def _record(self, module: torch.nn.Module, args: tuple[Any, ...], _out: Any) -> None:
        self.passes[-1].append((module, args[0].shape[0]))

    def last_with_rows(self, rows: int) -> list[tuple[torch.nn.Module, int]]:
        """The calls of the last recorded pass whose first linear saw `rows` rows."""
        return next(p for p in reversed(self.passes) if p and p[0][1] == rows)

    @staticmethod
    def seconds(calls: list[tuple[torch.nn.Module, int]], dtype: torch.dtype, repeats: int) -> float:
        """Best time of running `calls` back to back on random inputs of the recorded shapes."""
        inputs = {(m.in_features, n): torch.randn(n, m.in_features).to(dtype) for m, n in calls}

        def run() -> None:
            for m, n in calls:
                m(inputs[m.in_features, n])

        with torch.inference_mode():
            return _best(run, repeats)


def _packable(dtype: torch.dtype) -> bool:
    from cothink.models.packing import can_pack

    return can_pack(dtype, "cpu")


def _packed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


class BusyCore:
    """Another process keeping one core busy (a Python spin loop) while the block runs."""

    def __enter__(self) -> BusyCore:
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.3)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()
