"""The ``cothink`` command line.

Heavy modules (torch, transformers, the runtime) are imported inside the subcommands so that
``cothink --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

DEFAULT_MODEL = "smollm2"
DTYPES = ("float32", "bfloat16")
# models/quantize.py QUANTIZE_MODES, named here so a parser imports no torch (a test keeps them equal)
QUANTIZE_MODES = ("int8", "int4")
# the CPU features cothink's kernels and torch's CPU kernels take faster paths with (x86 flags, Arm
# features), as /proc/cpuinfo names them
CPU_FLAGS = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "asimddp", "sve", "sve2", "bf16",
    "i8mm",
)


def stream_generation(
    model: str,
    prompt: str,
    *,
    max_tokens: int,
    dtype: str,
    system: str | None = None,
    quantize: str | None = None,
    raw: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Load `model` and stream a greedy completion of `prompt` to `out` through the engine.

    Returns the number of generated tokens; timing goes to `err`.
    """
    import torch

    from cothink.runtime.sync import SyncEngine
    from cothink.models.text import chat_prompt_ids

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    t0 = time.perf_counter()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    with SyncEngine.from_pretrained(model, dtype=torch_dtype, quantize=quantize) as engine:
        ids = chat_prompt_ids(engine.tokenizer, prompt, system=system, raw=raw)
        t_loaded = time.perf_counter()
        prompt_block, answer = engine.block("prompt"), engine.block("answer")
        engine.extend(prompt_block, token_ids=ids)
        count, t_first = 0, None
        for piece in engine.stream([prompt_block, answer], max_tokens=max_tokens, name="generate"):
            t_first = t_first or time.perf_counter()
            count += len(piece.token_ids)
            out.write(piece.text)
            out.flush()
        out.write("\n")
    t_end = time.perf_counter()
    first = (t_first or t_end) - t_loaded
    decode_s = t_end - (t_first or t_end)
    rate = (count - 1) / decode_s if count > 1 and decode_s > 0 else float("nan")
    print(
        f"[{count} tokens; load {t_loaded - t0:.2f}s, prompt {len(ids)} tokens + first token {first:.2f}s, "
        f"decode {rate:.1f} tok/s, {dtype}{f', {quantize} weights' if quantize else ''}]",
        file=err,
    )
    return count


# ----------------------------------------------------------------------------------------- commands


def _cmd_prepare(args: argparse.Namespace) -> int:
    from cothink.models.hub import prepare_model

    print(prepare_model(args.model, force=args.force))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    stream_generation(
        args.model,
        args.prompt,
        max_tokens=args.max_tokens,
        dtype=args.dtype,
        system=args.system,
        raw=args.raw,
        quantize=args.quantize,
    )
    return 0


def machine_report() -> dict[str, Any]:
    """What `cothink info` prints: versions, the CPU, torch's threads and the C kernels' status
    (building them on first use)."""
    import torch

    import cothink
    from cothink.ops import native

    from cothink.run_info import cpu_flags, cpu_model

    kernels, flags = native.status(), cpu_flags()
    return {
        "cothink": cothink.__version__,
        "location": str(Path(cothink.__file__).parent),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "cpu_flags": [f for f in CPU_FLAGS if f in flags],
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "native": kernels.available,
        "kernels": asdict(kernels),
    }


def _cmd_info(args: argparse.Namespace) -> int:
    report = machine_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    kernels = report["kernels"]
    if kernels["available"]:
        native = f"true ({kernels['library']}, ABI {kernels['abi']})"
    else:
        native = f"false: {kernels['reason']}"
    rows = [
        ("cothink", f"{report['cothink']} ({report['location']})"),
        ("python", report["python"]),
        ("torch", report["torch"]),
        ("cpu", report["cpu"]),
        ("cpu flags", " ".join(report["cpu_flags"]) or "none of those cothink uses"),
        ("threads", f"{report['torch_threads']} torch threads, {report['cores']} cores"),
        ("native", native + (" (required: COTHINK_REQUIRE_NATIVE=1)" if kernels["required"] else "")),
    ]
    for name, value in rows:
        print(f"{name + ':':<11}{value}")
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from cothink.runtime.recorder import replay

    report = replay(args.file, model=args.model, device=args.device)
    print(report.describe())
    return 0 if report.identical else 1


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cothink",
        description="cothink: a PyTorch runtime for asynchronous LLM reasoning.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "prepare",
        help="make a model ready to load (converts an embedded model once) and print its folder",
        description="Resolve MODEL (an embedded name such as 'smollm2' or 'qwen2.5-coder-1.5b', or a local "
        "Hugging Face folder), converting the embedded GGUF into a cached safetensors folder if needed, and "
        "print the folder. A GGUF shipped in parts (the Qwen2.5-Coder models) is joined from its installed "
        "packages and refused unless its size and SHA-256 are the published file's.",
    )
    from cothink.models.hub import known_model_names

    p.add_argument("model", metavar="MODEL",
                   help=f"embedded model name ({', '.join(known_model_names())}) or a local model folder")
    p.add_argument("--force", action="store_true", help="convert again even if the cached folder exists")
    p.set_defaults(func=_cmd_prepare)

    def add_common(q: argparse.ArgumentParser, max_tokens: int) -> None:
        q.add_argument(
            "--model", default=DEFAULT_MODEL, help=f"model name or folder (default: {DEFAULT_MODEL})"
        )
        q.add_argument(
            "--max-tokens",
            type=_positive_int,
            default=max_tokens,
            help=f"most new tokens (default: {max_tokens})",
        )
        q.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype (default: float32)")
        q.add_argument(
            "--quantize", choices=QUANTIZE_MODES, default=None,
            help="weight-only int8 or 4-bit linears (Llama, Qwen2, Qwen3)"
        )

    p = sub.add_parser(
        "generate",
        help="stream a greedy chat completion to stdout",
        description="Stream a greedy completion of PROMPT (wrapped in the model's chat template) to stdout; "
        "timing goes to stderr.",
    )
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    add_common(p, 256)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser(
        "info",
        help="print the versions, the CPU and whether cothink's C kernels run here (and why not)",
        description="Print cothink's, Python's and torch's versions, the CPU model and the features its "
        "kernels use, torch's threads, and the C kernels' status: native true, or false with the reason "
        "(switched off, no C compiler, the compiler's message). Builds the kernels if they are not cached.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser(
        "replay",
        help="re-run a recorded engine run (cothink.Recorder, serve --record) and check it",
        description="Re-run FILE on a fresh engine of the recorded model, making every call at the step "
        "it was made, and compare every step's tokens and every probe's answer. Prints the first step "
        "that differs (coroutine, recorded and replayed values); exits 0 when the replay is identical, "
        "1 when it differs.",
    )
    p.add_argument("file", metavar="FILE", help="a recording (JSON lines)")
    p.add_argument("--model", default=None, help="model name or folder (default: the one recorded)")
    p.add_argument("--device", default="cpu", help="device (default: cpu)")
    p.set_defaults(func=_cmd_replay)

    from cothink.agents import demo
    from cothink.server import cli as server_cli

    demo.add_parser(sub)
    server_cli.add_parser(sub)
    from cothink.eval.cli import add_parser as add_eval_parser

    add_eval_parser(sub)
    from cothink.experiments.harness import add_parser as add_experiment_parser
    from cothink.layouts.cli import add_parser as add_layout_parser

    add_experiment_parser(sub)
    add_layout_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(version("cothink"))
        except PackageNotFoundError:
            print("unknown")
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    from cothink.errors import CothinkError

    try:
        return int(args.func(args) or 0)
    except CothinkError as exc:
        print(f"cothink: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
