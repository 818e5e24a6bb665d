"""Weight-only 4-bit: quality against the same model unquantized (perplexity on a fixed text and greedy
agreement), and decode speed against cothink's own bfloat16, in one process.

    python bench/int4_quality.py             # SmolLM2
    python bench/int4_quality.py --quick

Variants, all with bfloat16 activations: "bfloat16"; "int4", `quantize="int4"` (the layers' 4-bit
weights: for the embedded SmolLM2 the shipped GGUF's Q4_1 tensors as they are, the weights llama.cpp
runs from that file; the lm_head int8); and, where the model has such a GGUF, "int4_requantized": every
layer quantized at load from the bfloat16 weights instead (models/quant4.py `Int4Weights.quantize`).
Perplexity and greedy agreement as bench/int8_quality.py computes them (its text and prompts), and the
perplexity of the text fed 32 tokens a step ("stepped"): the whole text in one step takes the wide
products (4-bit: the dequantized weight in a GEMM, bfloat16 activations), 32-token steps the products a
decode takes (4-bit: the C kernel in pairs with 8-bit activations, models/quant4.py). With
--llama-cpp (the `peers` extra), llama.cpp's perplexity of the same text from the model's shipped GGUF
and from its Q8_0 and BF16 re-encodings (bench/peers.py `reencoded_gguf`, made once into --out). Writes
int4_quality.json to --out.
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
from int8_quality import PROMPTS, TEXT, measure  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_common_args(p)
    p.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per prompt (default 48)")
    p.add_argument("--llama-cpp", action="store_true",
                   help="also llama.cpp's perplexity of the shipped GGUF and its Q8_0 and BF16 re-encodings")
    args = p.parse_args(argv)
    args.new_tokens = args.new_tokens or (16 if args.quick else 48)
    return args


def requantized_runner(model: str) -> Any:
    """`quantize="int4"` with every layer quantized from the bfloat16 weights, for a model whose
    checkpoint has a 4-bit GGUF source (None: it has none, "int4" is already that)."""
    from unittest import mock

    from cothink.execution.runner import load_model
    from cothink.models import weights
    from cothink.models.quant4 import checkpoint_gguf

    if checkpoint_gguf(C.model_folder(model)) is None:
        return None
    with mock.patch.object(weights, "checkpoint_gguf", lambda _folder: None):  # the GGUF not read
        return load_model(model, dtype=torch.bfloat16, quantize="int4", kv_tokens=4096)


def stepped_perplexity(runner: Any, ids: list[int], rows: int = 32) -> float:
    """Perplexity of `ids` extended `rows` tokens a step (NATIVE_MAX_ROWS: the C kernel's products)."""
    block = runner.new_block()
    logits = torch.cat([runner.extend(block, ids[i : i + rows]).float() for i in range(0, len(ids), rows)])
    return float(torch.exp(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))))


def llama_cpp_perplexity(gguf: Path, ids: list[int], threads: int) -> float:
    """llama.cpp's perplexity of `ids` (one batch, every position's logits) with the weights of `gguf`."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=max(512, len(ids)), n_batch=max(512, len(ids)),
                          n_threads=threads, logits_all=True, verbose=False)
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))


def llama_cpp_perplexities(model: str, ids: list[int], out: Path, threads: int) -> dict[str, float]:
    """llama.cpp's perplexity from the model's shipped GGUF and its Q8_0 and BF16 re-encodings ({} without
    one)."""
    from peers import _embedded_gguf, reencoded_gguf

    shipped = _embedded_gguf(model)
    if shipped is None:
        return {}
    files = [shipped] + [reencoded_gguf(shipped, out / "llama.cpp" / f"{shipped.stem}.{qtype}.gguf", qtype)
                         for qtype in ("Q8_0", "BF16")]
    return {gguf.name: llama_cpp_perplexity(gguf, ids, threads) for gguf in files}


def main(argv: list[str] | None = None) -> int:
    from cothink.execution.runner import load_model

    args = parse_args(argv)
    C.setup(args)
    console = C.console()
    info = C.machine()
    console.print(f"int4 quality: {args.model} on {C.machine_line(info)}")
    runners = {
        "bfloat16": load_model(args.model, dtype=torch.bfloat16, kv_tokens=4096),
        "int4": load_model(args.model, dtype=torch.bfloat16, quantize="int4", kv_tokens=4096),
    }
    requantized = requantized_runner(args.model)
    if requantized is not None:
        runners["int4_requantized"] = requantized
    prompts = PROMPTS[:2] if args.quick else PROMPTS
    pairs = [(name, "bfloat16") for name in runners if name != "bfloat16"]
    results = measure(runners, prompts, args.new_tokens, pairs)
    ppl = results["perplexity"]
    change = {name: f" ({100 * (value / ppl['bfloat16'] - 1):+.2f}%)" for name, value in ppl.items()}
    change["bfloat16"] = ""
    console.print(f"perplexity on a fixed {results['text_tokens']}-token text: "
                  + ", ".join(f"{name} {value:.3f}{change[name]}" for name, value in ppl.items()))
    text_ids = next(iter(runners.values())).tokenizer(TEXT)["input_ids"]
    stepped = {name: stepped_perplexity(runner, text_ids) for name, runner in runners.items()}
    results["perplexity_stepped"] = stepped
    console.print("perplexity, the text in 32-token steps (the decode's products): " + ", ".join(
        f"{name} {value:.3f} ({100 * (value / stepped['bfloat16'] - 1):+.2f}%)"
        for name, value in stepped.items()))
    if args.llama_cpp:
        theirs = results["llama_cpp_perplexity"] = llama_cpp_perplexities(
            args.model, text_ids, args.out, torch.get_num_threads())
        console.print("llama.cpp perplexity, the whole text: " + ", ".join(
            f"{name} {value:.3f}" for name, value in theirs.items()))
    for row in results["greedy"]:
        console.print(f"  {row['prompt']!r}: agreement with bfloat16 (first difference at, of "
                      f"{args.new_tokens}): " + ", ".join(
                          f"{name} {row[f'prefix_{name}_vs_bfloat16']} "
                          f"({row[f'share_{name}_vs_bfloat16']:.0%} of positions)"
                          for name in runners if name != "bfloat16"))
    speed = results["decode_tok_s"]
    console.print("decode tok/s (this run, greedy loop on the runner): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in speed.items()))
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    data = {"benchmark": "int4_quality", "machine": info, "settings": settings, "results": results}
    C.write_json(args.out / "int4_quality.json", data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
