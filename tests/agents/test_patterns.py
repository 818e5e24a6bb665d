"""The four agent patterns on a tiny random Qwen3.5 hybrid (chat template, byte-level BPE) and on SmolLM2.

Random weights say nothing useful: these tests check the mechanics (who read what, when, at what cost),
which the patterns promise whatever the model says.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import cothink
from cothink.agents import AgentEvent, Monitor, StrategistActor, StreamAgent, ThinkNarrate
from cothink.agents.base import ObservationWindow


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> Path:
    from cothink.eval.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("agents") / "hybrid", hybrid=True, seed=5)


def _engine(folder: Path | str):
    return cothink.Engine.from_pretrained(folder, kv_tokens=8192)


def run(coro):
    return asyncio.run(coro)


async def live_blocks(engine, timeout: float = 5.0) -> int:
    """Blocks still alive once released blocks were reclaimed (the engine frees them between steps)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while engine.memory().live_blocks and loop.time() < end:
        await asyncio.sleep(0.01)
    return engine.memory().live_blocks


async def _lines(lines, delay: float = 0.0):
    for line in lines:
        if delay:
            await asyncio.sleep(delay)
        yield line


# ---------------------------------------------------------------------------------- think + narrate


def _think_narrate(folder, max_tokens: int, narrate_every: int):
    async def main():
        async with _engine(folder) as engine:
            agent = ThinkNarrate(
                engine,
                task="What is 3 + 4? Think step by step.",
                max_tokens=max_tokens,
                narrate_every=narrate_every,
                narration_tokens=6,
                name="tn",
            )

            async def user():
                await agent.wait_progress(max_tokens // 3)
                if not agent.done:
                    await agent.tell("Use 5 instead of 4.")
                agent.end_input()

            result, _ = await asyncio.gather(agent.run(), user())
            stats = {k: v for k, v in engine.stats.items()}
            agent.release()
            return agent, result, stats, engine.tokenizer

    return run(main())


@pytest.mark.parametrize("model", ["hybrid", "smollm2"])
def test_think_narrate_reads_live_and_takes_input(model, hybrid_dir):
    folder = hybrid_dir if model == "hybrid" else "smollm2"
    max_tokens, every = (36, 8) if model == "hybrid" else (18, 6)
    agent, result, stats, tok = _think_narrate(folder, max_tokens, every)
    # the user's input went into the context the thinker reads, mid-reasoning, with no restart
    assert result.inputs_at and 0 < result.inputs_at[0] < max_tokens
    assert "Use 5 instead of 4." in tok.decode(result.ctx_tokens)
    assert result.thinker_generated >= max_tokens - 1
    # the thinker's block holds what it wrote (opener, generated, reaction), all charged to it
    assert stats["tn.thinker"].tokens_written == result.thinker_block_len
    assert result.thinker_reaction_tokens > 0
    # narrator syncs: probes after every `every` thinker tokens, a final narration at the end
    probes = [e for e in result.events if e.kind == "probe"]
    assert probes and all(e.coroutine == "tn.narrator" and 0 <= e.value <= 1 for e in probes)
    assert result.syncs[-1].final and result.syncs[-1].spoke and result.syncs[-1].text
    said = [e for e in result.events if e.kind == "said"]
    assert said and all(isinstance(e, AgentEvent) and e.forward_passes > 0 for e in said)
    assert [e.time for e in result.events] == sorted(e.time for e in result.events)
    # a text-passing narrator would have re-read ctx + the thinker's text at every sync
    assert all(
        s.text_passing_reencode == s.ctx_len + s.thinker_len and s.thinker_len > 0 for s in result.syncs
    )
    assert [s.thinker_len for s in result.syncs] == sorted(s.thinker_len for s in result.syncs)


# ------------------------------------------------------------------------------------- stream agent


def test_stream_agent_drops_stale_events_and_speaks(hybrid_dir):
    async def main():
        async with _engine(hybrid_dir) as engine:
            agent = StreamAgent(
                engine,
                task="Comment on the match.",
                event_threshold=0.0,
                output_threshold=0.0,
                min_gap_s=0.0,
                max_pending=2,
                describe_tokens=5,
                think_tokens=8,
                name="sa",
            )
            storm = [f"player {i} passes the ball" for i in range(12)]  # all at once: a storm
            return await agent.run(_lines(storm))

    result = run(main())
    assert result.events_seen == 12 and result.events_dropped > 0
    assert result.events_seen == result.events_dropped + len([e for e in result.events if e.kind == "event"])
    assert result.utterances and not any(u.forced for u in result.utterances)
    assert result.forward_passes["event"] > 0 and result.forward_passes["describer"] > 0
    assert result.forward_passes["coordinator"] == 1  # only the context prompt: routing is model-free
    dropped = [e.text for e in result.events if e.kind == "dropped"]
    assert dropped[0].startswith("[0]")  # the oldest events go first


def test_stream_agent_timing_min_gap_and_max_silence(hybrid_dir):
    async def main(**kw):
        async with _engine(hybrid_dir) as engine:
            agent = StreamAgent(
                engine,
                task="Comment.",
                event_threshold=0.0,
                describe_tokens=4,
                think_tokens=0,
                max_pending=50,
                **kw,
            )
            return await agent.run(_lines([f"event {i}" for i in range(5)], delay=0.05))

    # a long minimum gap: one utterance, however many new events
    gap = run(main(output_threshold=0.0, min_gap_s=1000.0, max_silence_s=2000.0))
    assert len(gap.utterances) == 1 and gap.new_events == 5
    # the output probe never says yes, but news left unsaid for max_silence_s is said anyway
    quiet = run(main(output_threshold=1.01, min_gap_s=0.0, max_silence_s=0.05))
    assert quiet.utterances and all(u.forced for u in quiet.utterances)


# ------------------------------------------------------------------------------- strategist + actor


class Corridor:
    """A real (tiny) environment: walk from 0 to the goal at 4; 'forward' moves, others waste a tick."""

    def __init__(self):
        self.position = 0
        self.done = False

    async def observe(self) -> str:
        await asyncio.sleep(0.01)
        return f"position {self.position}, goal at 4"

    async def act(self, action: str) -> float:
        if action == "forward":
            self.position += 1
        self.done = self.position >= 4
        return 1.0 if action == "forward" else -0.1


@pytest.mark.parametrize("mode", ["async", "probe-only", "sequential"])
def test_strategist_actor_modes(mode, hybrid_dir):
    async def main():
        async with _engine(hybrid_dir) as engine:
            agent = StrategistActor(
                engine,
                task="Reach the goal.",
                actions=["left", "right", "forward"],
                mode=mode,
                early_exit=0.0 if mode == "async" else 0.8,
                think_tokens=4,
                plan_tokens=6,
                window_tokens=64,
                chunk_tokens=32,
                name="sa",
            )
            env = Corridor()
            result = await agent.run(env, ticks=8)
            # the strategist stopped with the run and every block was released
            return result, await live_blocks(engine)

    result, live = run(main())
    assert len(result.actions) >= 1 and live == 0
    assert all(a.action in ("left", "right", "forward") and 0 <= a.probability <= 1 for a in result.actions)
    assert [a.tick for a in result.actions] == list(range(len(result.actions)))
    if mode == "async":
        assert all(a.early_exit for a in result.actions)  # threshold 0: the first probe decides
        assert result.strategist_forward_passes > 0
        # the actor never waits for the strategist: a tick costs the actor a probe's passes only
        assert max(a.forward_passes for a in result.actions) <= 3
    elif mode == "probe-only":
        assert result.strategist_forward_passes == 0 and not result.plans
        assert max(a.forward_passes for a in result.actions) <= 3
    else:
        assert result.strategist_forward_passes == 0 and not any(a.early_exit for a in result.actions)
        assert min(a.forward_passes for a in result.actions) > 4  # reasoning every tick
        assert any(e.kind == "thought" for e in result.events)


def test_strategist_swaps_plans_while_the_actor_reasons(hybrid_dir):
    """Async mode where the plan never fits (threshold above 1): the actor exits every plan it reads and
    decides on a second probe while the strategist replaces plans meanwhile; a dropped or replaced plan
    block stays alive until the actor's decision is done (tests/agents/test_strategist.py: the rule)."""

    async def main():
        async with _engine(hybrid_dir) as engine:
            agent = StrategistActor(
                engine,
                task="Reach the goal.",
                actions=["left", "right", "forward"],
                early_exit=1.01,
                think_tokens=6,
                plan_tokens=2,
                window_tokens=48,
                chunk_tokens=16,
                name="swap",
            )
            result = await agent.run(Corridor(), ticks=8)
            return result, await live_blocks(engine)

    result, live = run(main())
    assert len(result.plans) >= 2 and all(a.replanned for a in result.actions if a.plan >= 0)
    assert any(a.plan >= 0 for a in result.actions) and live == 0


# ------------------------------------------------------------------------------------------ monitor


def test_monitor_bounded_window_and_findings(hybrid_dir):
    log = [f"12:00:{i:02d} worker rss={100 + 7 * i}MB handles={20 + i}" for i in range(30)]

    async def main(**kw):
        async with _engine(hybrid_dir) as engine:
            mon = Monitor(
                engine,
                task="Watch the worker log.",
                kinds=["memory leak", "handle exhaustion"],
                window_tokens=96,
                chunk_tokens=32,
                name="mon",
                **kw,
            )
            result = await mon.run(_lines(log))
            return result, await live_blocks(engine)

    # never crosses the threshold: watches the whole stream; old observations leave memory
    quiet, live = run(main(threshold=1.01))
    assert quiet.observations == 30 and quiet.checks == 30 and not quiet.findings
    assert quiet.dropped_chunks > 0 and live == 0
    # threshold 0 with a focus prompt: a finding at the first check, typed, with evidence
    found, _ = run(main(threshold=0.0, focus="Report memory growth only."))
    assert len(found.findings) == 1 and found.observations == 1
    f = found.findings[0]
    assert f.type in ("memory leak", "handle exhaustion") and f.evidence == [log[0] + "\n"]
    assert [e.kind for e in found.events].count("finding") == 1
    # sequential baseline: thinks before each probe, so it costs more passes per check
    seq, _ = run(main(threshold=1.01, mode="sequential", think_tokens=3, check_every=10))
    assert seq.checks == 3 and any(e.kind == "thought" for e in seq.events)
    # a background thinker reads the window live
    thinking, _ = run(main(threshold=1.01, think_tokens=8, check_every=10))
    assert thinking.thinker_forward_passes > 0


def test_monitor_sequential_reasons_over_every_observation(hybrid_dir):
    """The sequential baseline writes reasoning about each observation, in turn, before its probe."""
    log = [f"12:00:{i:02d} worker rss={100 + 7 * i}MB" for i in range(9)]
    produced: list[str] = []

    async def source():
        for line in log:
            produced.append(line)
            yield line

    async def main():
        async with _engine(hybrid_dir) as engine:
            mon = Monitor(engine, task="Watch the worker log.", kinds=["memory leak", "crash loop"],
                          threshold=1.01, mode="sequential", think_tokens=2, name="seq")
            return await mon.run(source()), await live_blocks(engine)

    result, live = run(main())
    assert result.observations == len(produced) == len(log) and result.reasoned == len(produced)
    kinds = [e.kind for e in result.events if e.kind in ("input", "thought", "probe")]
    assert kinds == ["input", "thought", "probe"] * len(log)  # each observation: read, reasoned over, probed
    assert result.thinker_forward_passes == 0 and live == 0


def test_observation_window_bound(hybrid_dir):
    async def main():
        async with _engine(hybrid_dir) as engine:
            window = ObservationWindow(engine, "w", chunk_tokens=16, max_tokens=48)
            for i in range(20):
                await window.append(f"line {i} with some text\n", "w")
                assert window.tokens <= 48 + 16  # at most one chunk over while the newest fills
            texts, dropped = window.texts(), window.dropped_chunks
            window.close()
            return texts, dropped, await live_blocks(engine)

    texts, dropped, live = run(main())
    assert dropped > 0 and texts[-1] == "line 19 with some text\n" and "line 0 with some text\n" not in texts
    assert live == 0


def test_patterns_on_smollm2():
    """The stream agent, strategist/actor and monitor on the real model, briefly, on one engine."""

    async def main():
        async with _engine("smollm2") as engine:
            stream = await StreamAgent(
                engine,
                task="Comment on the football match.",
                event_threshold=0.0,
                output_threshold=0.0,
                min_gap_s=0.0,
                describe_tokens=6,
                think_tokens=6,
                name="stream",
            ).run(_lines(["Kick-off.", "A goal for the home team!"]))
            play = await StrategistActor(
                engine,
                task="Reach the goal by moving forward.",
                actions=["left", "right", "forward"],
                plan_tokens=6,
                think_tokens=3,
                name="play",
            ).run(Corridor(), ticks=3)
            watch = await Monitor(
                engine,
                task="Watch the worker log.",
                kinds=["memory leak", "crash loop"],
                threshold=0.0,
                name="watch",
            ).run(_lines(["rss=100MB", "rss=900MB"]))
            return stream, play, watch, await live_blocks(engine)

    stream, play, watch, live = run(main())
    assert stream.utterances and all(u.text for u in stream.utterances)
    assert len(play.actions) == 3 and all(a.action in ("left", "right", "forward") for a in play.actions)
    assert watch.findings and watch.findings[0].type in ("memory leak", "crash loop")
    assert live == 0
