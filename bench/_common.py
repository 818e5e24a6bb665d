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

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="smollm2",
        help="embedded model name or a local Hugging Face folder (default: smollm2)",
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
    """A rich console; 120 columns wide when the output is not a terminal (logs, files)."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=120)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover - not Linux
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover
        load = float("nan")
    return {
        "platform": platform.platform(),
        "processor": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_avg_1min_at_start": round(load, 2),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def model_folder(model: str) -> Path:
    from cothink.models.hub import resolve_model_path

    return Path(resolve_model_path(model))


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


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def fmt(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"
