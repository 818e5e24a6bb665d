"""The agent patterns over the HTTP session API: a real server on loopback, the async client, RemoteEngine."""

from __future__ import annotations

import asyncio

import pytest
from support import running_server, tiny_chat_model_dir, tiny_engine

from cothink.agents import Monitor, ThinkNarrate
from cothink.agents.remote import RemoteEngine
from cothink.client import AsyncClient


@pytest.fixture(scope="module")
def server():
    with running_server(tiny_engine(kv_tokens=8192)) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_chat_model_dir()))


async def _lines(lines):
    for line in lines:
        yield line


def test_think_narrate_over_http(server, tokenizer):
    async def main():
        async with AsyncClient(server.url) as client:
            async with await client.session("tn") as session:
                engine = RemoteEngine(session, tokenizer)
                agent = ThinkNarrate(
                    engine, task="What is 2 + 2?", max_tokens=24, narrate_every=8, narration_tokens=4
                )

                async def user():
                    await agent.wait_progress(8)
                    if not agent.done:
                        await agent.tell("Use 3 instead of 2.")
                    agent.end_input()

                result, _ = await asyncio.gather(agent.run(), user())
                ctx = await session.get_block(agent._ctx.id, token_ids=True)
                thinker = await session.get_block(agent._block.id, token_ids=True)
                return result, ctx, thinker

    result, ctx, thinker = asyncio.run(main())
    # the input went into the server-side context block while the thinker ran there
    assert result.inputs_at and "Use 3 instead of 2." in ctx.text
    # what the agent tracked locally is what the server's blocks hold
    assert ctx.token_ids == result.ctx_tokens and thinker.length == result.thinker_block_len
    assert result.thinker_generated >= 20 and result.syncs and result.syncs[-1].final
    assert any(e.kind == "probe" for e in result.events) and any(e.kind == "said" for e in result.events)


def test_monitor_over_http(server, tokenizer):
    async def main():
        async with AsyncClient(server.url) as client:
            async with await client.session("mon") as session:
                engine = RemoteEngine(session, tokenizer)
                mon = Monitor(
                    engine,
                    task="Watch the log.",
                    kinds=["memory leak", "crash loop"],
                    threshold=1.01,
                    window_tokens=64,
                    chunk_tokens=24,
                )
                result = await mon.run(_lines([f"rss={100 + 10 * i}MB" for i in range(20)]))
                await asyncio.sleep(0.2)
                return result, await session.blocks()

    result, blocks = asyncio.run(main())
    assert result.observations == 20 and result.checks == 20 and result.dropped_chunks > 0
    assert blocks == []  # every block the monitor made on the server was deleted
