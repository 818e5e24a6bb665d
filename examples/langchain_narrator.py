"""A LangChain agent whose tools look inside a thinker running in the same engine.

    python examples/langchain_narrator.py                  # SmolLM2, in-process (needs cothink[langchain])

A thinker coroutine reasons about a problem in the background, writing its `thoughts` block. The
narrator is an ordinary LangChain tool-calling agent (`ChatCothink`, LangChain's ChatOpenAI against
the same engine): its tools read the thoughts written so far and *probe* them ("has the answer been
found?") with one forward pass over the thinker's live memory: no copy, no re-encode, while the
thinker keeps going. The agent's tool calls are grammar-constrained, so they always parse.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool

import cothink
from cothink.integrations.langchain import ChatCothink

PROBLEM = (
    "A farmer has 17 sheep. All but 9 run away. Then he buys twice as many as he has left. "
    "How many sheep does he have now?"
)


async def run(
    model: str = "smollm2", think_tokens: int = 160, agent_tokens: int = 96, out=sys.stdout
) -> dict:
    engine = cothink.Engine.from_pretrained(model)
    chat = ChatCothink.from_engine(engine, model="local", max_tokens=agent_tokens, temperature=0)
    try:
        async with chat.cothink.client() as client:
            session = await client.session("narrated")
            problem = await session.block(f"Problem: {PROBLEM}\nLet us think step by step.\n")
            thoughts = await session.block()
            thinker = await session.start([problem, thoughts], max_tokens=think_tokens, name="thinker")

            @tool
            async def read_thoughts() -> str:
                """The thinker's reasoning so far."""
                return (await session.get_block(thoughts)).text or "(nothing yet)"

            @tool
            async def answer_found() -> str:
                """Probability that the thinker has already found the final answer."""
                probs = await session.probe(
                    [problem, thoughts], "\nHas the final answer been found? Answer:", [" yes", " no"]
                )
                return f"{probs[' yes']:.2f}"

            tools = {t.name: t for t in (read_thoughts, answer_found)}
            agent = chat.bind_tools(list(tools.values()), tool_choice="required")
            messages = [
                SystemMessage("You narrate another model's reasoning for a reader, in one sentence."),
                HumanMessage("Check on the thinker."),
            ]
            trace = []
            await asyncio.sleep(0.5)  # let the thinker get going
            for _ in range(2):  # two looks while the thinker writes
                call = (await agent.ainvoke(messages)).tool_calls[0]
                result = await tools[call["name"]].ainvoke(call["args"])
                trace.append({"tool": call["name"], "result": result[:200]})
                print(f"[narrator] {call['name']} -> {result[:120]!r}", file=out)
                messages += [_call_message(call), ToolMessage(result, tool_call_id=call["id"])]
            summary = await chat.ainvoke(messages + [HumanMessage("Now tell the reader, in one sentence.")])
            print(f"[narrator] {summary.content}", file=out)
            await session.cancel(thinker["id"])
            return {"trace": trace, "summary": summary.content}
    finally:
        chat.close()


def _call_message(call: dict):
    from langchain_core.messages import AIMessage

    return AIMessage(content="", tool_calls=[call])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--think-tokens", type=int, default=160)
    args = p.parse_args(argv)
    result = asyncio.run(run(args.model, args.think_tokens))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
