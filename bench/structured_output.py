"""Constrained-decoding overhead: what a JSON-schema grammar (llguidance) costs per generated token.

    python bench/structured_output.py            # SmolLM2, ~2 minutes on a 2-core CPU
    python bench/structured_output.py --quick    # fewer tokens and repeats

For each schema of a small set (nested objects, enums, arrays), the engine generates the same number of
tokens greedily with and without the constraint (`engine.generate(..., constraint=...)`), after the
same prompt. Reported per schema: seconds per token with and without, the overhead per token, the
grammar's own time per token (mask + advance, measured inside the constraint), and whether every
finished output parsed. Writes structured_output.json to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "mood": {"enum": ["happy", "sad", "neutral"]},
            "confident": {"type": "boolean"},
            "score": {"type": "number"},
        },
        "required": ["mood", "confident", "score"],
    },
    "arrays": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}},
            "points": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["tags", "points"],
    },
}
PROMPT = "Describe a person (name and address), their mood and some tags, as JSON."


class TimedConstraint:
    """Wraps a constraint and adds up the time spent in it (the grammar's share of each token)."""

    def __init__(self, inner: Any):
        self.inner, self.seconds, self.calls = inner, 0.0, 0

    def allowed(self):
        t = time.perf_counter()
        try:
            return self.inner.allowed()
        finally:
            self.seconds += time.perf_counter() - t
            self.calls += 1

    def advance(self, token_id: int) -> None:
        t = time.perf_counter()
        self.inner.advance(token_id)
        self.seconds += time.perf_counter() - t

    def done(self) -> bool:
        return self.inner.done()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import cothink
    from cothink.structured import GrammarCompiler

    engine = cothink.Engine.from_pretrained(C.model_folder(args.model))
    tok = engine.tokenizer
    grammars = GrammarCompiler(tok)
    grammars.warm()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    out: dict[str, Any] = {"machine": C.machine(), "model": args.model, "schemas": {}}
    async with engine:
        ctx = engine.block("prompt")
        await engine.extend(ctx, prompt)
        for name, schema in SCHEMAS.items():
            free, constrained, grammar_s, tokens, parsed = [], [], 0.0, 0, []
            for _ in range(args.repeats):
                for with_grammar in (False, True):
                    block = engine.fork(ctx)
                    constraint = TimedConstraint(grammars.json_schema(schema)) if with_grammar else None
                    t = time.perf_counter()
                    result = await engine.generate(
                        [block], max_tokens=args.tokens, constraint=constraint
                    ).collect()
                    per_token = (time.perf_counter() - t) / max(1, len(result.token_ids))
                    engine.release(block)
                    if with_grammar:
                        constrained.append(per_token)
                        grammar_s += constraint.seconds
                        tokens += len(result.token_ids)
                        if result.finish_reason == "stop":
                            try:
                                json.loads(result.text)
                                parsed.append(True)
                            except json.JSONDecodeError:
                                parsed.append(False)
                    else:
                        free.append(per_token)
            out["schemas"][name] = {
                "s_per_token_free": min(free),
                "s_per_token_constrained": min(constrained),
                "overhead_s_per_token": min(constrained) - min(free),
                "grammar_s_per_token": grammar_s / max(1, tokens),
                "finished": len(parsed),
                "parsed": sum(parsed),
            }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_common_args(p)
    p.add_argument("--tokens", type=int, default=64, help="tokens per generation (default 64)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.repeats = 24, 1
    C.setup(args)
    result = asyncio.run(run(args))
    path = C.write_json(args.out / "structured_output.json", result)
    con = C.console()
    for name, r in result["schemas"].items():
        con.print(
            f"{name:8s} free {r['s_per_token_free'] * 1e3:7.2f} ms/token  constrained "
            f"{r['s_per_token_constrained'] * 1e3:7.2f} ms/token  "
            f"grammar {r['grammar_s_per_token'] * 1e3:6.3f} ms/token  parsed {r['parsed']}/{r['finished']}"
        )
    con.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
