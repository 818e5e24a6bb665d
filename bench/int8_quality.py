"""Weight-only int8: quality against the same model unquantized (perplexity on a fixed text and
greedy agreement), and decode speed against cothink's own bfloat16, in one process.

    python bench/int8_quality.py             # SmolLM2
    python bench/int8_quality.py --quick

Perplexity: the fixed English text below, prefilled whole, logits of every position (float32,
bfloat16, bfloat16 + int8 weights). Greedy agreement: for each prompt, --new-tokens greedy tokens of
the int8 model against the bfloat16 and float32 models (positions equal until the first difference,
and position by position). Writes int8_quality.json to --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import cothink  # noqa: E402,F401  sets the OpenMP wait policy, so it precedes torch
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from those used to make "
    "wine. Before his invention, books were copied by hand, a slow and costly process that kept "
    "written knowledge in the hands of a few. Within fifty years, presses had spread to more than two "
    "hundred cities across Europe, and millions of volumes had been printed. Cheaper books encouraged "
    "literacy, helped scientists share their results quickly and accurately, and allowed new religious "
    "and political ideas to travel far beyond their authors. Historians still debate how much of the "
    "scientific revolution depended on print, but few doubt that the ability to reproduce identical "
    "copies of diagrams, tables and arguments changed the way people learned. Today, digital text has "
    "taken over many of the roles once played by paper, yet the basic idea remains the same: a "
    "technology that makes copying cheap changes who can read, write and take part in public life."
)
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_common_args(p)
    p.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per prompt (default 48)")
    args = p.parse_args(argv)
    args.new_tokens = args.new_tokens or (16 if args.quick else 48)
    return args


def perplexity(runner: Any, ids: list[int]) -> float:
    logits = runner.extend(runner.new_block(), ids)
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]))
    return float(torch.exp(nll))


def greedy(runner: Any, prompt: list[int], n: int) -> tuple[list[int], float]:
    block = runner.new_block()
    logits = runner.extend(block, prompt, logits="last")
    out = []
    t = time.perf_counter()
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = runner.extend(block, out[-1:], logits="last")
    return out, time.perf_counter() - t


def agreement(a: list[int], b: list[int]) -> tuple[int, float]:
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return prefix, sum(x == y for x, y in zip(a, b)) / max(1, len(a))


def measure(
    runners: dict[str, Any], prompts: list[str], new_tokens: int, pairs: list[tuple[str, str]]
) -> dict[str, Any]:
    """Each runner's perplexity on TEXT and greedy continuations of `prompts` (chat turns), with each
    (a, b) pair's agreement per prompt (`prefix_a_vs_b`: tokens equal until the first difference,
    `share_a_vs_b`: share of equal positions) and each runner's decode tokens/s."""
    from cothink.models.text import chat_prompt_ids

    tok = next(iter(runners.values())).tokenizer
    text_ids = tok(TEXT)["input_ids"]
    results: dict[str, Any] = {
        "text_tokens": len(text_ids),
        "perplexity": {name: perplexity(runner, text_ids) for name, runner in runners.items()},
        "greedy": [],
    }
    times = dict.fromkeys(runners, 0.0)
    for prompt in prompts:
        ids = chat_prompt_ids(tok, prompt)
        outs = {}
        for name, runner in runners.items():
            outs[name], dt = greedy(runner, ids, new_tokens)
            times[name] += dt
        row: dict[str, Any] = {"prompt": prompt}
        for a, b in pairs:
            row[f"prefix_{a}_vs_{b}"], row[f"share_{a}_vs_{b}"] = agreement(outs[a], outs[b])
        results["greedy"].append(row)
    results["decode_tok_s"] = {name: len(prompts) * new_tokens / t for name, t in times.items()}
    return results


def main(argv: list[str] | None = None) -> int:
    from cothink.execution.runner import load_model

    args = parse_args(argv)
    C.setup(args)
    console = C.console()
    info = C.machine()
    console.print(f"int8 quality: {args.model} on {info['cpu']}, {info['torch_threads']} threads")
    variants = {
        "float32": dict(dtype=torch.float32),
        "bfloat16": dict(dtype=torch.bfloat16),
        "int8": dict(dtype=torch.bfloat16, quantize="int8"),
    }
    runners = {name: load_model(args.model, kv_tokens=4096, **kw) for name, kw in variants.items()}
    prompts = PROMPTS[:2] if args.quick else PROMPTS
    pairs = [("int8", "bfloat16"), ("int8", "float32"), ("bfloat16", "float32")]
    results = measure(runners, prompts, args.new_tokens, pairs)
    ppl = results["perplexity"]
    console.print(
        f"perplexity on a fixed {results['text_tokens']}-token text: float32 {ppl['float32']:.3f}, bfloat16 "
        f"{ppl['bfloat16']:.3f}, int8 {ppl['int8']:.3f} "
        f"({100 * (ppl['int8'] / ppl['bfloat16'] - 1):+.2f}% vs bf16)"
    )
    for row in results["greedy"]:
        console.print(
            f"  {row['prompt']!r}: int8 agrees with bf16 for the first {row['prefix_int8_vs_bfloat16']} "
            f"of {args.new_tokens} tokens ({row['share_int8_vs_bfloat16']:.0%} of positions), with fp32 "
            f"for {row['prefix_int8_vs_float32']} (bf16 vs fp32: {row['prefix_bfloat16_vs_float32']})"
        )
    speed = results["decode_tok_s"]
    console.print(
        "decode tok/s (this run, greedy loop on the runner): "
        + ", ".join(f"{k} {v:.1f}" for k, v in speed.items())
        + f"; int8 / bf16 {speed['int8'] / speed['bfloat16']:.2f}"
    )
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    data = {"benchmark": "int8_quality", "machine": info, "settings": settings, "results": results}
    C.write_json(args.out / "int8_quality.json", data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
