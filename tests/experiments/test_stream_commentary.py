"""Stream commentary: the timing metric on hand-made cases, live frames that never wait for the model,
and a --quick run on a tiny model."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import numpy as np
import pytest

from cothink.errors import InvalidParameterError
from cothink.experiments import harness
from cothink.experiments import stream_commentary as sc
from cothink.experiments.streams import procedural_stream


def test_auc_perfect_random_constant():
    labels = [i % 5 == 0 for i in range(200)]
    assert sc.roc_auc([float(y) for y in labels], labels) == 1.0
    assert sc.roc_auc([1.0 - float(y) for y in labels], labels) == 0.0
    assert sc.roc_auc([0.3] * 200, labels) == 0.5
    rng = random.Random(0)
    big = [rng.random() < 0.3 for _ in range(4000)]
    assert abs(sc.roc_auc([rng.random() for _ in big], big) - 0.5) < 0.03
    assert sc.roc_auc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == 0.75
    assert sc.roc_auc([0.5, 0.5], [True, True]) != sc.roc_auc([0.5, 0.5], [True, True])  # nan: one class


def test_truth_window_and_mentions():
    assert sc.event_truth([2, 9], 12, fps=2.0, window_s=1.5) == [
        False, False, True, True, True, False, False, False, False, True, True, True]
    assert sc.event_delays([1.0, 5.0, 9.0], [1.4, 2.0, 7.5], window_s=2.0) == [pytest.approx(0.4), None, None]


def _rows(scores, spoke, stream):
    """Rows of one method for a hand-made speaker over `stream` (fps 1, W 2 s)."""
    config = _config(fps=1.0)
    tl = sc.Timeline(scores=[(t + 0.5, s) for t, s in enumerate(scores)],
                     said=[(t + 0.5, "x") for t, s in enumerate(spoke) if s])
    return sc.tick_rows(stream, "stream-agent", sc.MethodRun(tl, len(stream.ticks), 0, 0, 0), config)


def _config(**kw):
    base = dict(experiment=sc.NAME, model="m", source="procedural", frames="text", fps=2.0, episodes=1,
                ticks=40, window_s=2.0, interval_s=4.0, last_frames=4, max_pending=2, min_gap_s=1.0,
                max_silence_s=10.0,
                think_tokens=0, describe_tokens=4, threshold=0.5, methods=["stream-agent"])
    return sc.CommentaryConfig(**{**base, **kw})


def test_perfect_speaker_scores_one_and_mentions_everything():
    stream = procedural_stream(5, 60, pixels=False)
    truth = sc.event_truth(stream.event_ticks, 60, fps=1.0, window_s=2.0)
    perfect = sc.summarize(_rows([float(y) for y in truth], truth, stream))
    assert perfect["stream-agent"]["auc"] == 1.0 and perfect["stream-agent"]["auc_spoke"] == 1.0
    assert perfect["stream-agent"]["mentioned"] == 1.0
    assert perfect["stream-agent"]["mean_delay_s"] == pytest.approx(0.5)
    constant = sc.summarize(_rows([0.7] * 60, [False] * 60, stream))["stream-agent"]
    assert constant["auc"] == 0.5 and constant["mentioned"] == 0.0 and constant["mean_delay_s"] is None


def test_live_frames_never_wait_for_a_slow_model(tiny, monkeypatch):
    """Every forward pass is made slow (50 ms more in the engine's worker thread); frames keep arriving
    on the clock while the model computes: the coordinator reads all of them and drops the stale ones."""
    from cothink.execution.runner import ModelRunner

    handle = harness.load_model(str(tiny))
    stream = procedural_stream(1, 30, pixels=False)
    config = _config(fps=50.0, think_tokens=8)
    live = sc.LiveFrames([sc.frame_text(t.tick, t.text) for t in stream.ticks], config.fps)
    overlapped = [0, 0]  # forward passes; those during which frames were handed out
    forward = ModelRunner.forward

    def slow_forward(self, *args, **kwargs):
        before = live.handed
        time.sleep(0.05)
        overlapped[0] += 1
        overlapped[1] += live.handed > before
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "forward", slow_forward)

    async def go():
        engine = handle.engine(kv_tokens=8192)
        passes = [0]
        async with engine:
            engine.step_listeners.append(lambda record: passes.__setitem__(0, passes[0] + 1))
            live.usage = sc._usage(engine, passes)
            return await sc.run_stream_agent(engine, live, sc.TASKS["procedural"], config), passes[0]

    run, passes = asyncio.run(go())
    assert live.handed == 30 and run.seen == 30  # every frame was handed out and read
    assert overlapped[1] > 0  # frames arrived while a forward pass was running
    # at >= 50 ms a pass the agent can have judged only a few of them: the rest were dropped as stale
    judged = len(run.timeline.scores)
    assert run.dropped > 0 and judged + run.dropped <= run.seen and judged <= passes
    assert len(live.timeline.usage) == 30  # cost sampled at every tick's end, on the clock


def test_pixels_need_vision(tiny, tmp_path):
    with pytest.raises(InvalidParameterError, match="needs a vision model"):
        sc.run_experiment(_config(model=str(tiny), frames="pixels"), tmp_path)
    assert not (tmp_path / "results.json").exists()


def test_quick_pixel_run_on_a_vision_model(tmp_path):
    """--frames pixels on a tiny multimodal model with random weights (the run is real; its numbers say
    nothing about any trained model): every method runs over frame groups, and the stream agent's and
    turn-based's engines read images."""
    from support import tiny_vision_folder

    folder = tiny_vision_folder("qwen35_vl")
    out = tmp_path / "out"
    parser = argparse.ArgumentParser()
    harness.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["experiment", "stream-commentary", "--model", str(folder), "--quick", "--out",
                              str(out), "--no-progress", "--interval", "0.5", "--frames", "pixels",
                              "--ticks", "8", "--threshold", "0.0", "--min-gap", "0"])
    assert args.func(args) == 0
    results = harness.read_results(out / "results.json", sc.CommentaryConfig, sc.CommentaryRow)
    assert results.config.frames == "pixels"
    by = {m: [r for r in results.rows if r.method == m] for m in sc.METHODS}
    assert all(len(rows) == 8 for rows in by.values())  # per tick, though frames came two at a time
    for m in sc.MODEL_METHODS:
        assert sum(r.forward_passes for r in by[m]) > 0 and sum(r.tokens_encoded for r in by[m]) > 0
    assert any(r.spoke for r in by["turn-based"])  # threshold 0: it speaks over the pixel frames
    fixed = [r.utterance for r in by["fixed-interval"] if r.spoke]
    assert fixed and all("frame(s) at" in u for u in fixed)
    assert results.config.streams[by["fixed-interval"][0].stream]["frames"]["stream-agent"][0] == 4  # groups


def test_pixel_frames_reach_the_engine_as_frame_groups():
    """The live pixel stream: one Frames per two ticks, at the group's timestamp, due at its last tick."""
    stream = procedural_stream(3, 5)
    live = sc.live_frames(stream, _config(frames="pixels", fps=2.0), 2)
    assert [f.timestamp for f in live.frames] == [0.25, 1.25, 2.0]
    assert live.due == [0.5, 1.5, 2.0] and live.n_ticks == 5
    assert [len(f.frames) for f in live.frames] == [2, 2, 1] and live.frames[1].label == "frame 2"
    assert (live.frames[1].frames[0] == stream.pixels[2]).all()


def test_frame_diff_scores_exactly_the_frames_that_change():
    """The model-free change detector: score 1 for a frame whose content differs from the previous
    frame's (a text frame's index line does not count; a frame group compares its frames and the
    previous group's last one), 0 otherwise; it speaks on changes, --min-gap apart."""
    from types import SimpleNamespace

    from cothink.agents.stream import Frames

    texts = ["a", "a", "b", "b", "c", "c"]
    live = sc.LiveFrames([sc.frame_text(i, t) for i, t in enumerate(texts)], fps=200.0)
    run = asyncio.run(sc.run_frame_diff(live, SimpleNamespace(min_gap_s=0.0)))
    assert [s for _, s in run.timeline.scores] == [0.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert [u for _, u in run.timeline.said] == ["frame 2 | b", "frame 4 | c"]
    live = sc.LiveFrames([sc.frame_text(i, t) for i, t in enumerate(texts)], fps=200.0)
    run = asyncio.run(sc.run_frame_diff(live, SimpleNamespace(min_gap_s=60.0)))
    assert len(run.timeline.said) == 1  # the second change came within the gap
    still, moved = np.zeros((4, 4, 3), np.uint8), np.ones((4, 4, 3), np.uint8)
    groups = [Frames([still, still], 0.0), Frames([still, still], 1.0), Frames([still, moved], 2.0),
              Frames([moved, moved], 3.0), Frames([still, still], 4.0)]
    run = asyncio.run(sc.run_frame_diff(sc.LiveFrames(groups, fps=200.0), SimpleNamespace(min_gap_s=0.0)))
    assert [s for _, s in run.timeline.scores] == [0.0, 0.0, 1.0, 0.0, 1.0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from cothink.eval.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "hybrid", hybrid=True, seed=5)


def test_quick_run_and_replay(tiny, tmp_path):
    out = tmp_path / "out"
    parser = argparse.ArgumentParser()
    harness.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["experiment", "stream-commentary", "--model", str(tiny), "--quick", "--out",
                              str(out), "--no-progress", "--interval", "0.5"])
    assert args.func(args) == 0
    raw = json.loads((out / "results.json").read_text())
    assert set(raw["summary"]) == set(sc.METHODS)
    assert (out / "report.md").exists() and (out / "stream_commentary.png").stat().st_size > 1000
    results = harness.read_results(out / "results.json", sc.CommentaryConfig, sc.CommentaryRow)
    ticks = results.config.ticks
    assert len(results.rows) == len(sc.METHODS) * ticks and raw["config"]["machine"]["torch"]
    by = {m: [r for r in results.rows if r.method == m] for m in sc.METHODS}
    assert sum(r.forward_passes for r in by["stream-agent"]) > 0
    assert sum(r.tokens_encoded for r in by["turn-based"]) > 0
    fixed = by["fixed-interval"]
    assert sum(r.forward_passes for r in fixed) == 0 and any(r.spoke for r in fixed)
    diff = by["frame-diff"]  # a procedural scene changes only at its events
    assert sum(r.forward_passes for r in diff) == 0
    assert {r.tick for r in diff if r.p_speak == 1.0} <= {r.tick for r in diff if r.events}
    for m, entry in raw["summary"].items():
        assert entry["ticks"] == ticks and entry["events"] == sum(bool(r.events) for r in by[m])
    # the saved stream replays: the same frames and truth, through --stream
    (saved,) = sorted((out / "streams").glob("*.jsonl"))
    again = parser.parse_args(["experiment", "stream-commentary", "--model", str(tiny), "--quick", "--out",
                               str(tmp_path / "again"), "--no-progress", "--stream", str(saved),
                               "--methods", "fixed-interval", "--interval", "0.5"])
    assert again.func(again) == 0
    replay = harness.read_results(tmp_path / "again" / "results.json", sc.CommentaryConfig, sc.CommentaryRow)
    assert [(r.tick, r.events, r.event_truth) for r in replay.rows] == [
        (r.tick, r.events, r.event_truth) for r in by["fixed-interval"]]
