"""A thinker and a narrator sharing one model's memory, over HTTP.

Start a server, then run this against it:

    cothink serve --model smollm2 &
    python examples/http_thinker_narrator.py --url http://127.0.0.1:8000

The thinker streams its reasoning into the `thoughts` block. Meanwhile the narrator reads the same
memory, problem + thoughts as they grow, with no copy and no re-encode: every few thinker tokens it
probes "is there something new worth telling?", and when the answer is yes it writes one short
sentence into a narration block of its own, placed after the thoughts in its view. Both coroutines run
in the server's one engine, batched into the same forward passes.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from cothink.client import AsyncClient

PROBLEM = (
    "A farmer has 17 sheep. All but 9 run away. Then he buys twice as many as he has left. "
    "How many sheep does he have now?"
)
NEWS_QUESTION = "\nQuestion: did the reasoning above reach a new intermediate result? Answer:"


async def run(
    url: str,
    api_key: str | None = None,
    problem: str = PROBLEM,
    think_tokens: int = 96,
    every: int = 16,
    narrate_tokens: int = 20,
    threshold: float = 0.5,
    out=sys.stdout,
) -> dict:
    """Run the thinker and the narrator once; returns {"thoughts", "narration", "probes"}."""
    async with AsyncClient(url, api_key=api_key) as client:
        async with await client.session("thinker-narrator") as s:
            context = await s.block(f"Problem: {problem}\nLet's think step by step.\n", name="problem")
            thoughts = await s.block(name="thoughts")
            produced = asyncio.Event()
            state = {"tokens": 0, "done": False}
            narration: list[str] = []
            probes: list[float] = []

            async def thinker() -> str:
                text = ""
                async for event in s.stream(
                    [context, thoughts],
                    max_tokens=think_tokens,
                    priority="background",
                    name="thinker",
                    stop_at_eos=True,
                ):
                    if event["type"] == "token":
                        text += event["text"]
                        state["tokens"] += len(event["token_ids"])
                        produced.set()
                    elif event["type"] == "end":
                        text = event["text"]
                state["done"] = True
                produced.set()
                return text

            async def narrator() -> None:
                next_look = every
                while not state["done"]:
                    await produced.wait()
                    produced.clear()
                    if state["tokens"] < next_look and not state["done"]:
                        continue
                    next_look = state["tokens"] + every
                    # The narrator reads the thinker's block while it grows: same memory, no copy.
                    p = await s.probe([context, thoughts], NEWS_QUESTION, priority="interactive")
                    probes.append(p[" yes"])
                    if p[" yes"] < threshold:
                        continue
                    line = await s.block("\nIn one short sentence, the progress so far is:", name="narration")
                    result = await s.generate(
                        [context, thoughts, line],
                        max_tokens=narrate_tokens,
                        priority="interactive",
                        name="narrator",
                    )
                    # keep the first non-empty line (small models often open with a newline)
                    lines = [x.strip() for x in result["text"].splitlines() if x.strip()]
                    narration.append(lines[0] if lines else "")
                    print(
                        f"\n  [narrator after {state['tokens']} thinker tokens] {narration[-1]}",
                        file=out,
                        flush=True,
                    )
                    await s.delete_block(line)  # the narration was for the listener, not the thinker

            print(f"problem: {problem}\nthinking...", file=out, flush=True)
            thought, _ = await asyncio.gather(thinker(), narrator())
            print(f"\nthoughts:\n{thought}", file=out, flush=True)
            return {"thoughts": thought, "narration": narration, "probes": probes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--problem", default=PROBLEM)
    parser.add_argument("--think-tokens", type=int, default=96)
    parser.add_argument("--every", type=int, default=16, help="thinker tokens between narrator probes")
    parser.add_argument(
        "--threshold",
        type=float,
        default=0.5,
        help="narrate when P(yes) reaches this (tiny models are shy: try 0.15 with smollm2)",
    )
    args = parser.parse_args(argv)
    result = asyncio.run(
        run(args.url, args.api_key, args.problem, args.think_tokens, args.every, threshold=args.threshold)
    )
    print(f"\n{len(result['narration'])} narrations from {len(result['probes'])} probes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
