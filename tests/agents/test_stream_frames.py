"""The stream agent fed pixel frame groups (and text events mixed in) on a tiny multimodal model with
random weights: each group lands in the agent's observation window as one frame group at its
timestamp, the event probe compares it with the previous group, and the event probe, the thinker,
the output probe and the describer all run over it."""

from __future__ import annotations

import asyncio

import numpy as np

import cothink
from cothink.agents import StreamAgent
from cothink.agents.stream import Frames
from support import tiny_vision_folder

VIDEO, VS, VE = 297, 298, 299


def _frame(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (24, 24, 3), dtype=np.uint8)


async def _events(groups: list[Frames], text_at: int):
    for i, group in enumerate(groups):
        if i == text_at:
            yield "the camera pans left"
        yield group
        await asyncio.sleep(0.01)


def test_frame_groups_land_in_the_window_with_their_timestamps():
    engine = cothink.Engine.from_pretrained(tiny_vision_folder("qwen35_vl"), kv_tokens=8192)
    tok = engine.tokenizer
    groups = [Frames([_frame(2 * t), _frame(2 * t + 1)], 0.5 * t, label="cam" if t == 0 else "")
              for t in range(4)]
    seen: dict = {}

    async def main():
        async with engine:
            agent = StreamAgent(engine, task="Comment on the camera.", event_threshold=0.0,
                                output_threshold=0.0, min_gap_s=0.0, max_pending=50, describe_tokens=4,
                                think_tokens=6, window_tokens=4096, chunk_tokens=4096, name="cam")
            original = agent.probe_yes

            async def probe_yes(view, question, role, **kw):  # read the window as the probes see it
                if role == "event":
                    seen["tokens"] = [t for b in view[1:] for t in b.tokens]
                    seen.setdefault("questions", []).append(question)
                return await original(view, question, role, **kw)

            agent.probe_yes = probe_yes
            return await agent.run(_events(groups, text_at=2))

    result = asyncio.run(main())
    assert result.events_seen == 5 and result.events_dropped == 0
    tokens = seen["tokens"]
    assert tokens.count(VS) == tokens.count(VE) == 4  # one vision run per frame group
    text = tok.decode([t for t in tokens if t not in (VIDEO, VS, VE)])
    stamps = [text.index(f"<{0.5 * t:.1f} seconds>") for t in range(4)]
    assert stamps == sorted(stamps), text  # in stream order, each group at its timestamp
    assert text.index("[0] cam") < stamps[0] and text.index("the camera pans left") < stamps[2]
    # the event probe compares each frame group with the previous one (both in the window); text: new?
    questions = seen["questions"]
    assert "Compare" not in questions[0] and "new" in questions[2]
    assert "frames [1] with frames [0]" in questions[1]
    assert "frames [3] with frames [1]" in questions[3] and "frames [4] with frames [3]" in questions[4]
    said = [e.text for e in result.events if e.kind == "event"]
    assert said[0] == "2 frame(s) at 0.0 s cam" and said[2] == "the camera pans left"
    for role in ("event", "thinker", "output", "describer"):
        assert result.forward_passes[role] > 0, (role, result.forward_passes)
    assert result.utterances
