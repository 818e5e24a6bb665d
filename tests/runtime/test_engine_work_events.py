"""Work events carry what a live view draws: a work's view, a generation's pieces, pause and resume,
a probe's answer."""

from __future__ import annotations

import pytest
from support import ids, make_engine, until


async def test_work_events_tell_views_pieces_pauses_and_answers():
    engine = make_engine("llama")
    events = []
    engine.work_listeners.append(events.append)
    async with engine:
        ctx, out = engine.block("ctx"), engine.block("out")
        await engine.extend(ctx, token_ids=ids(12, 1), name="feed")
        gen = engine.generate([ctx, out], max_tokens=12, name="G")
        await until(lambda: len(out) >= 3)
        gen.pause()
        gen.pause()  # already paused: no second event
        probs = await engine.probe([ctx], ids(4, 2), (" yes", " no"), name="P")
        gen.resume()
        result = await gen.collect()

    submits = {e.coroutine: e for e in events if e.event == "submit"}
    assert submits["feed"].view == ("ctx",) and submits["feed"].value == 12
    assert submits["G"].view == ("ctx", "out") and submits["P"].view == ("ctx",)
    assert submits["P"].value == 4

    pieces = [e for e in events if e.event == "piece"]
    assert {e.coroutine for e in pieces} == {"G"}
    assert sum(e.value for e in pieces) == len(result.token_ids) == 12
    assert "".join(e.text for e in pieces) == result.text
    order = [e.event for e in events if e.coroutine == "G"]
    assert order.count("paused") == 1 and order.count("resumed") == 1
    assert order.index("paused") < order.index("resumed") < order.index("finish")

    (answer,) = [e for e in events if e.event == "finish" and e.coroutine == "P"]
    assert dict(answer.answer) == pytest.approx(probs)
    assert all(not e.answer for e in events if e.event == "finish" and e.coroutine != "P")
