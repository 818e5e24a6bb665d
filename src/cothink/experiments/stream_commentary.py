"""Stream commentary: speak about a live stream at the right moments (`cothink experiment stream-commentary`).

Streams (`cothink.experiments.streams`): procedural scenes or recorded ViZDoom episodes, with exact event
ticks, or stream files (``--source FILE``). Each stream is played LIVE: a producer task hands frame i to
the method at wall time ``i / --fps`` after the start, whatever the method is doing; a method that is
busy when frames arrive finds them queued, and all but the newest ``--max-pending`` are dropped as stale
(counted).

What the model sees (``--frames``): ``text``, each frame as its text line; or ``pixels`` (a multimodal
model with its vision tower), the stream's pixel frames in groups of the model's temporal patch (two
frames, `cothink.experiments.streams.frame_groups`), each handed out when its last frame is shown and
written with ``engine.extend(block, frames=..., timestamp=...)`` after a ``frame N`` line; the text
frames are then never shown. The truth labels and the metric stay per tick.

Methods, on the same streams:

- `stream-agent`: `cothink.agents.StreamAgent` (event probe, background thinker, output probe,
  describer, model-free coordinator). Its per-tick speak score is the event probe's latest P(something
  new happened) at the end of the tick; the output probe and the coordinator's timing decide whether it
  speaks.
- `turn-based` (text passing): for every frame it takes, a fresh context re-encodes the system prompt,
  the task and the last ``--last-frames`` frames, and one probe asks whether to speak now (its P(yes) is
  the speak score); on yes (and ``--min-gap`` since the last utterance) it writes a sentence there.
- `fixed-interval`: model-free, speaks every ``--interval`` seconds (score 1 at those ticks, else 0);
  its utterance is the newest frame's text (pixels: which frames).
- `frame-diff`: model-free change detector: score 1 for a frame that differs from the one before it (a
  text frame's content, its index line left out; a frame group's pixels, the previous group's last frame
  included), else 0; it speaks on a change (and ``--min-gap``). What a score that moves with any change
  in the input reaches: the ceiling a model's AUC must beat to show judgement rather than change.

Metric (per method, ticks pooled over streams): timing ROC-AUC of the per-tick speak score against the
label "an event happened within the last ``--window`` seconds" (W; ties count one half, so a constant
score gives 0.5); the same AUC of the binary spoke/silent; mean delay from an event to the first
utterance within W after it; the share of events mentioned (an utterance within W after it); forward
passes and tokens encoded (prefill + generated, every coroutine).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cothink.errors import InvalidParameterError
from cothink.experiments import harness
from cothink.experiments.harness import ExperimentConfig, Results, Row
from cothink.experiments.streams import (
    Stream,
    event_summary,
    frame_groups,
    load_stream,
    save_stream,
    streams_for,
)

NAME = "stream-commentary"
log = logging.getLogger("cothink.experiments.stream_commentary")
METHODS = ("stream-agent", "turn-based", "fixed-interval", "frame-diff")
MODEL_METHODS = ("stream-agent", "turn-based")
SYSTEM = "You comment on a live stream. Be brief and concrete."
TASKS = {
    "procedural": "You watch a live scene: a sign with a digit and coloured shapes on a board. Each frame "
    "lists them. Comment when something changes: a shape appears, vanishes, moves or changes colour, or "
    "the digit changes.",
    "vizdoom": "You watch a live Doom game. Each frame gives the game tic, the player's health, the recent "
    "reward and the objects in view. Comment when something happens: the player is hurt, picks up an "
    "item, kills an enemy, is nearly dead or dies.",
}
SPEAK_QUESTION = "Is there something worth saying now? Answer Yes or No."
DESCRIBE = "In one short sentence, what is happening now?"
PIXEL_TASK = "You see the frames as video, two frames at a time."


class CommentaryConfig(ExperimentConfig):
    source: str  # procedural | vizdoom | a stream file
    frames: str  # text | pixels (a vision model)
    fps: float
    episodes: int
    ticks: int  # frames per built-in stream (most, for vizdoom)
    window_s: float  # W
    interval_s: float  # fixed-interval speaker
    last_frames: int  # turn-based: frames re-encoded per decision
    max_pending: int
    min_gap_s: float
    max_silence_s: float
    think_tokens: int
    describe_tokens: int
    threshold: float  # output probe / turn-based probe threshold
    methods: list[str]
    # stream name -> ticks, events by kind, and per method [frames seen, frames dropped]
    streams: dict[str, dict[str, Any]] = {}


class CommentaryRow(Row):
    stream: str
    method: str
    tick: int
    t: float  # seconds: tick / fps
    events: list[str]  # kinds of the events first visible in this tick's frame
    p_speak: float  # the method's speak score at the end of this tick
    spoke: bool
    said_at: float | None  # seconds (stream clock) of the first utterance in this tick
    utterance: str | None  # what it said in this tick (several: joined with " / ")
    event_truth: bool  # an event happened within the last W seconds
    delay_s: float | None  # spoke: seconds since the latest event, when that is within W
    mention_delay_s: float | None  # a tick with events: seconds to the first utterance within W after it
    forward_passes: int  # engine passes during this tick
    tokens_encoded: int  # tokens written into memory during this tick


# ------------------------------------------------------------------------------------------ metric


def roc_auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """P(score of a positive > score of a negative), ties counting one half (Mann-Whitney with average
    ranks); nan when either class is empty."""
    pos = sum(1 for y in labels if y)
    neg = len(labels) - pos
    if not pos or not neg:
        return float("nan")
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1  # average rank of the tie group
        i = j + 1
    rank_sum = sum(r for r, y in zip(ranks, labels) if y)
    return (rank_sum - pos * (pos + 1) / 2) / (pos * neg)


def event_truth(event_ticks: Sequence[int], n_ticks: int, fps: float, window_s: float) -> list[bool]:
    """Per tick: did an event happen within the last `window_s` seconds (at this tick or before)?"""
    out = [False] * n_ticks
    for e in event_ticks:
        for t in range(e, n_ticks):
            if (t - e) / fps >= window_s:
                break
            out[t] = True
    return out


def event_delays(event_times: Sequence[float], speech_times: Sequence[float], window_s: float) -> list[
    float | None
]:
    """Per event: seconds to the first utterance within `window_s` after it (None: not mentioned)."""
    out: list[float | None] = []
    for e in event_times:
        after = [s - e for s in speech_times if 0 <= s - e < window_s]
        out.append(min(after) if after else None)
    return out


# -------------------------------------------------------------------------------------- live clock


@dataclass
class Timeline:
    """What a method did, on the stream's clock (seconds since the first frame was due)."""

    scores: list[tuple[float, float]] = field(default_factory=list)  # (time, speak score)
    said: list[tuple[float, str]] = field(default_factory=list)  # (time, utterance)
    usage: list[tuple[int, int]] = field(default_factory=list)  # per tick end: (passes, tokens) so far


@dataclass
class LiveFrames:
    """Frames handed out on a wall clock: frame i at ``i / fps`` seconds after the first (or at `due[i]`
    seconds: frame groups, each when its last frame is shown). Iterating never waits for the consumer's
    model; a late wake-up hands out every frame already due at once, and the consumer's bounded queue
    drops the stale ones. `usage` (a callable giving (passes, tokens) so far) is sampled at the end of
    each of the stream's `ticks` (default: one per frame)."""

    frames: list[Any]  # text frames (str) or frame groups (cothink.agents.stream.Frames)
    fps: float
    usage: Any = None
    timeline: Timeline = field(default_factory=Timeline)
    t0: float = 0.0
    handed: int = 0
    due: list[float] | None = None
    ticks: int | None = None

    @property
    def n_ticks(self) -> int:
        return len(self.frames) if self.ticks is None else self.ticks

    def now(self) -> float:
        """Seconds since the first frame was handed out (the clock starts at the first read)."""
        return time.perf_counter() - self.t0

    def _sample(self, upto: float) -> None:
        usage = self.timeline.usage
        while len(usage) < self.n_ticks and (len(usage) + 1) / self.fps <= upto:
            usage.append(self.usage() if self.usage is not None else (0, 0))

    async def __aiter__(self) -> AsyncIterator[Any]:
        self.t0 = time.perf_counter()
        for i, frame in enumerate(self.frames):
            wait = (i / self.fps if self.due is None else self.due[i]) - self.now()
            if wait > 0:
                await asyncio.sleep(wait)
            self._sample(self.now())
            self.handed += 1
            yield frame
        wait = self.n_ticks / self.fps - self.now()  # the last tick lasts its full period
        if wait > 0:
            await asyncio.sleep(wait)
        self._sample(self.now())


def frame_text(i: int, text: str) -> str:
    return f"frame {i}\n{text}"


def live_frames(stream: Stream, config: CommentaryConfig, temporal_patch_size: int,
                usage: Any = None) -> LiveFrames:
    """The stream as the method receives it: text frames, or pixel frame groups (`config.frames`)."""
    if config.frames == "text":
        return LiveFrames([frame_text(t.tick, t.text) for t in stream.ticks], config.fps, usage)
    from cothink.agents.stream import Frames

    groups = list(frame_groups(stream, temporal_patch_size, config.fps))
    frames = [Frames(list(g.frames), g.timestamp, label=f"frame {g.ticks[0]}") for g in groups]
    return LiveFrames(frames, config.fps, usage, due=[g.due for g in groups], ticks=len(stream.ticks))


def frame_label(frame: Any) -> str:
    """A frame in one line: its text, or which frames a pixel group holds."""
    return frame.replace("\n", " | ") if isinstance(frame, str) else str(frame)


async def write_turn(engine: Any, block: Any, chat: Any, task: str, frames: Sequence[Any]) -> None:
    """[system, user: task + frames] into `block` through the chat template; pixel frame groups go
    inside the user's turn, each after its ``frame N`` line."""
    if all(isinstance(f, str) for f in frames):
        prompt = chat.conversation([{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": task + "\n\n" + "\n".join(frames)}])
        await engine.extend(block, prompt, name="turn-based", priority="interactive")
        return
    mark = "\x00FRAMES\x00"
    head, _, tail = chat.conversation([{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": task + "\n\n" + mark}]).partition(mark)
    await engine.extend(block, head, name="turn-based", priority="interactive")
    for f in frames:
        await engine.extend(block, f"{f.label} ", name="turn-based", priority="interactive")
        await engine.extend(block, frames=f.frames, timestamp=f.timestamp, name="turn-based",
                            priority="interactive")
        await engine.extend(block, "\n", name="turn-based", priority="interactive")
    await engine.extend(block, tail, name="turn-based", priority="interactive")


# ----------------------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class MethodRun:
    timeline: Timeline
    seen: int
    dropped: int
    forward_passes: int
    tokens_encoded: int


def _usage(engine: Any, passes: list[int]) -> Any:
    return lambda: (passes[0], sum(s.tokens_written for s in engine.stats.values()))


async def run_stream_agent(engine: Any, live: LiveFrames, task: str, config: CommentaryConfig) -> MethodRun:
    from cothink.agents.stream import StreamAgent

    tl = live.timeline

    def on_event(ev: Any) -> None:
        if ev.kind == "probe" and ev.coroutine == "event" and ev.value is not None:
            tl.scores.append((live.now(), ev.value))
        elif ev.kind == "said":
            tl.said.append((live.now(), ev.text))

    agent = StreamAgent(
        engine,
        task=task,
        output_threshold=config.threshold,
        min_gap_s=config.min_gap_s,
        max_silence_s=config.max_silence_s,
        max_pending=config.max_pending,
        describe_tokens=config.describe_tokens,
        think_tokens=config.think_tokens,
        system=SYSTEM,
        on_event=on_event,
        seed=config.seed,
    )
    result = await agent.run(live)  # the clock starts when the agent first reads (after its prompt prefill)
    return MethodRun(tl, result.events_seen, result.events_dropped, 0, 0)


async def run_turn_based(engine: Any, live: LiveFrames, task: str, config: CommentaryConfig) -> MethodRun:
    """Text passing: per frame taken, re-encode [system, task + last N frames] and probe once."""
    from cothink.agents.chat import ChatFormat

    chat, tl = ChatFormat(engine.tokenizer), live.timeline
    pending: deque[Any] = deque()
    arrived, ended = asyncio.Event(), asyncio.Event()
    counts = {"seen": 0, "dropped": 0}

    async def intake() -> None:
        try:
            async for frame in live:
                pending.append(frame)
                counts["seen"] += 1
                while len(pending) > config.max_pending:
                    pending.popleft()
                    counts["dropped"] += 1
                arrived.set()
        finally:
            ended.set()
            arrived.set()

    reader = asyncio.create_task(intake())
    history: deque[Any] = deque(maxlen=config.last_frames)
    last_said = -math.inf
    try:
        while True:
            if not pending:
                if ended.is_set():
                    break
                arrived.clear()
                await arrived.wait()
                continue
            history.append(pending.popleft())
            block = engine.block("turn-based")
            try:
                await write_turn(engine, block, chat, task, list(history))
                question = chat.question(SPEAK_QUESTION)
                p = await engine.probe([block], question, ("Yes", "No"), name="turn-based")
                tl.scores.append((live.now(), float(p["Yes"])))
                if p["Yes"] >= config.threshold and live.now() - last_said >= config.min_gap_s:
                    await engine.extend(block, chat.question(DESCRIBE), name="turn-based")
                    res = await engine.generate([block], max_tokens=config.describe_tokens, stop=["\n", "."],
                                                name="turn-based", seed=config.seed).collect()
                    last_said = live.now()
                    tl.said.append((last_said, res.text.strip()))
            finally:
                engine.release(block)
    finally:
        await reader
    return MethodRun(tl, counts["seen"], counts["dropped"], 0, 0)


async def run_fixed_interval(live: LiveFrames, config: CommentaryConfig) -> MethodRun:
    tl, next_at = live.timeline, config.interval_s
    async for frame in live:
        if live.now() >= next_at:
            tl.scores.append((live.now(), 1.0))
            tl.said.append((live.now(), frame_label(frame)))
            next_at += config.interval_s
    return MethodRun(tl, live.handed, 0, 0, 0)


def _content(frame: Any) -> list[Any]:
    """What a frame shows, in order: a text frame without its index line, or a frame group's pixels."""
    if isinstance(frame, str):
        return [frame.split("\n", 1)[-1]]
    return [np.asarray(f) for f in frame.frames]


def _changed(before: list[Any], now: list[Any]) -> bool:
    """Whether anything differs from the previous frame's last content through this frame's."""
    seq = [before[-1], *now]
    return any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(seq, seq[1:]))


async def run_frame_diff(live: LiveFrames, config: CommentaryConfig) -> MethodRun:
    tl, before, last_said = live.timeline, None, -math.inf
    async for frame in live:
        now, content = live.now(), _content(frame)
        changed = before is not None and _changed(before, content)
        tl.scores.append((now, float(changed)))
        if changed and now - last_said >= config.min_gap_s:
            tl.said.append((now, frame_label(frame)))
            last_said = now
        before = content
    return MethodRun(tl, live.handed, 0, 0, 0)


async def run_method(handle: Any, stream: Stream, method: str, config: CommentaryConfig) -> MethodRun:
    task = TASKS.get(stream.source, TASKS["procedural"])
    if config.frames == "pixels":
        task += " " + PIXEL_TASK
    patch = temporal_patch(handle)
    if method == "fixed-interval":
        return await run_fixed_interval(live_frames(stream, config, patch), config)
    if method == "frame-diff":
        return await run_frame_diff(live_frames(stream, config, patch), config)
    engine = handle.engine(kv_tokens=16384)
    passes = [0]
    async with engine:
        engine.step_listeners.append(lambda record: passes.__setitem__(0, passes[0] + 1))
        live = live_frames(stream, config, patch, usage=_usage(engine, passes))
        if method == "stream-agent":
            done = await run_stream_agent(engine, live, task, config)
        else:
            done = await run_turn_based(engine, live, task, config)
        total = _usage(engine, passes)()
    return MethodRun(done.timeline, done.seen, done.dropped, total[0], total[1])


def tick_rows(stream: Stream, method: str, run: MethodRun, config: CommentaryConfig) -> list[CommentaryRow]:
    """One row per tick: the score in force at the tick's end, what was said in it (speech after the last
    tick's end counts in the last tick), the truth label, each event's mention delay, and the cost spent
    in the tick (the last tick also holds what was spent draining the queue after the stream ended)."""
    n, fps, tl = len(stream.ticks), config.fps, run.timeline
    truth = event_truth(stream.event_ticks, n, fps, config.window_s)
    usage = (list(tl.usage) + [tl.usage[-1] if tl.usage else (0, 0)] * n)[:n]
    if method in MODEL_METHODS:
        usage[-1] = (run.forward_passes, run.tokens_encoded)
    speech_times = [s for s, _ in tl.said]
    rows, score, prev = [], 0.0, (0, 0)
    scores = deque(sorted(tl.scores))
    for t in range(n):
        end = (t + 1) / fps if t < n - 1 else math.inf
        said = [(s, u) for s, u in tl.said if t / fps <= s < end]
        if method == "fixed-interval":
            score = 0.0  # its score is 1 only in the ticks it speaks
        while scores and scores[0][0] < end:
            score = scores.popleft()[1]
        delay = None
        if said:
            past = [e for e in stream.event_ticks if e / fps <= said[0][0]]
            if past and said[0][0] - past[-1] / fps < config.window_s:
                delay = round(said[0][0] - past[-1] / fps, 3)
        events = [e.kind for e in stream.ticks[t].events]
        mention = event_delays([t / fps], speech_times, config.window_s)[0] if events else None
        rows.append(CommentaryRow(
            stream=stream.name, method=method, tick=t, t=round(t / fps, 3), events=events,
            p_speak=round(score, 5), spoke=bool(said), said_at=round(said[0][0], 3) if said else None,
            utterance=" / ".join(u for _, u in said) if said else None, event_truth=truth[t], delay_s=delay,
            mention_delay_s=None if mention is None else round(mention, 3),
            forward_passes=usage[t][0] - prev[0], tokens_encoded=usage[t][1] - prev[1],
        ))
        prev = usage[t]
    return rows


# ----------------------------------------------------------------------------------------- summary


def summarize(rows: Sequence[CommentaryRow]) -> dict[str, Any]:
    """summary[method] = {auc, auc_spoke, mean_delay_s, mentioned, events, utterances, forward_passes,
    tokens_encoded, ticks, streams} over all its rows (ticks pooled over streams)."""
    out: dict[str, Any] = {}
    for method in dict.fromkeys(r.method for r in rows):
        rs = [r for r in rows if r.method == method]
        with_event = [r for r in rs if r.events]
        got = [r.mention_delay_s for r in with_event if r.mention_delay_s is not None]
        out[method] = {
            "auc": roc_auc([r.p_speak for r in rs], [r.event_truth for r in rs]),
            "auc_spoke": roc_auc([float(r.spoke) for r in rs], [r.event_truth for r in rs]),
            "mean_delay_s": statistics.fmean(got) if got else None,
            "mentioned": len(got) / len(with_event) if with_event else None,
            "events": len(with_event),
            "utterances": sum(r.spoke for r in rs),
            "forward_passes": sum(r.forward_passes for r in rs),
            "tokens_encoded": sum(r.tokens_encoded for r in rs),
            "ticks": len(rs),
            "streams": len({r.stream for r in rs}),
        }
    return out


def plot(path: Path, summary: dict[str, Any]) -> Path:
    """Per method: timing AUC (score and spoke), share of events mentioned, and tokens encoded."""
    methods = list(summary)
    with harness.figure(path, 2) as (left, right):
        x = range(len(methods))
        for k, (key, label) in enumerate((("auc", "AUC (score)"), ("auc_spoke", "AUC (spoke)"),
                                          ("mentioned", "share mentioned"))):
            vals = [summary[m][key] if summary[m][key] is not None else float("nan") for m in methods]
            left.bar([i + 0.27 * (k - 1) for i in x], vals, width=0.27, label=label)
        left.axhline(0.5, color="gray", linestyle="--", linewidth=1)
        left.set_xticks(list(x), methods)
        left.set_ylim(0, 1)
        left.set_title("timing")
        left.legend(fontsize=8)
        right.bar(list(x), [summary[m]["tokens_encoded"] for m in methods])
        right.set_xticks(list(x), methods)
        right.set_title("tokens encoded (all streams)")
    return path


def report(results: Results[CommentaryConfig, CommentaryRow]) -> str:
    c = results.config
    lines = [
        "# Stream commentary: when to speak",
        "",
        f"Model: {c.model_description or c.model} ({c.dtype}); source {c.source}, {c.frames} frames at "
        f"{c.fps:g} frames/s (wall clock); W = {c.window_s:g} s; fixed interval {c.interval_s:g} s; "
        f"turn-based re-encodes the last {c.last_frames} frames; queue {c.max_pending}; min gap "
        f"{c.min_gap_s:g} s, max silence {c.max_silence_s:g} s; output threshold {c.threshold:g}. "
        f"Machine: {harness.machine_line(c.machine)}; wall {c.wall_s:.0f} s.",
        "",
        harness.markdown_table(
            ["method", "AUC (score)", "AUC (spoke)", "mean delay (s)", "mentioned", "events", "utterances",
             "forward passes", "tokens encoded"],
            [[m, e["auc"], e["auc_spoke"], e["mean_delay_s"], e["mentioned"], e["events"], e["utterances"],
              e["forward_passes"], e["tokens_encoded"]] for m, e in results.summary.items()],
        ),
        "",
        "## Streams",
        "",
        harness.markdown_table(
            ["stream", "ticks", "events", *(f"{m}: seen / dropped" for m in c.methods)],
            [[name, s["ticks"], ", ".join(f"{k} {v}" for k, v in s["events"].items()) or "none",
              *(f"{s['frames'].get(m, ['', ''])[0]} / {s['frames'].get(m, ['', ''])[1]}" for m in c.methods)]
             for name, s in c.streams.items()],
        ),
        "",
        "![stream commentary](stream_commentary.png)",
        "",
    ]
    return "\n".join(lines)


FOLDER = harness.ResultsFolder(
    CommentaryConfig, CommentaryRow, summarize, lambda results, out: report(results), plot,
    "stream_commentary.png",
)
save = FOLDER.save
render = FOLDER.render


# --------------------------------------------------------------------------------------------- CLI


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", default="procedural",
                   help="procedural, vizdoom, or a stream file (.jsonl, see cothink.experiments.streams)")
    p.add_argument("--stream", type=Path, nargs="+", default=None,
                   help="stream files to replay (instead of --source)")
    p.add_argument("--frames", choices=("text", "pixels"), default="text",
                   help="what the model sees: text frames, or pixels (needs a vision model)")
    p.add_argument("--fps", type=float, default=2.0, help="frames per second of wall time (default 2)")
    p.add_argument("--episodes", type=int, default=3, help="built-in streams to generate (default 3)")
    p.add_argument("--ticks", type=int, default=40, help="frames per built-in stream (default 40)")
    p.add_argument("--window", type=float, default=2.0,
                   help="W: a tick is positive when an event happened within the last W seconds (default 2)")
    p.add_argument("--interval", type=float, default=4.0, help="fixed-interval speaker period, s (default 4)")
    p.add_argument("--last-frames", type=int, default=4, help="turn-based: frames re-encoded (default 4)")
    p.add_argument("--max-pending", type=int, default=2, help="queued frames kept (default 2)")
    p.add_argument("--min-gap", type=float, default=1.0, help="least seconds between utterances (default 1)")
    p.add_argument("--max-silence", type=float, default=10.0,
                   help="stream agent: speak after this many silent seconds with news unsaid (default 10)")
    p.add_argument("--think-tokens", type=int, default=32, help="stream agent: notes bound (default 32)")
    p.add_argument("--describe-tokens", type=int, default=16, help="most tokens per utterance (default 16)")
    p.add_argument("--threshold", type=float, default=0.5, help="speak probe threshold (default 0.5)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--save-streams", action=argparse.BooleanOptionalAction, default=True,
                   help="write the streams (JSONL + pixel sidecar) to DIR/streams for replay (default on)")


def build_config(args: argparse.Namespace) -> CommentaryConfig:
    quick = bool(args.quick)
    source = args.source if args.stream is None else ",".join(str(p) for p in args.stream)
    return CommentaryConfig(
        experiment=NAME, model=args.model, dtype=args.dtype, seed=args.seed, limit=args.limit, quick=quick,
        max_tokens=args.max_tokens, threads=args.threads, source=source, frames=args.frames,
        fps=max(args.fps, 8.0) if quick else args.fps, episodes=1 if quick else args.episodes,
        ticks=min(args.ticks, 12) if quick else args.ticks, window_s=args.window, interval_s=args.interval,
        last_frames=args.last_frames, max_pending=args.max_pending, min_gap_s=args.min_gap,
        max_silence_s=args.max_silence,
        think_tokens=min(args.think_tokens, 4) if quick else args.think_tokens,
        describe_tokens=min(args.describe_tokens, 4) if quick else args.describe_tokens,
        threshold=args.threshold, methods=args.methods,
    )


def temporal_patch(handle: Any) -> int:
    """Frames per group: the vision model's temporal patch (2 when no model reads the pixels)."""
    vision = getattr(getattr(handle, "runner", None), "vision", None)
    return vision.video.temporal_patch_size if vision is not None else 2


def check_frames(config: CommentaryConfig, handle: Any, streams: Sequence[Stream]) -> None:
    """Pixel frames need pixels in every stream and, for the model methods, a model with a vision
    tower (InvalidParameterError before anything runs)."""
    if config.frames != "pixels":
        return
    if handle is not None and handle.runner.vision is None:
        raise InvalidParameterError(
            f"--frames pixels needs a vision model (a multimodal checkpoint with its vision tower); "
            f"{config.model} has none: use --frames text", param="frames")
    for s in streams:
        if s.pixels is None:
            raise InvalidParameterError(f"--frames pixels: stream {s.name} has no pixel frames",
                                        param="frames")


def load_streams(config: CommentaryConfig, files: Sequence[Path] | None) -> list[Stream]:
    if files:
        return [load_stream(f) for f in files]
    if config.source in ("procedural", "vizdoom"):
        return streams_for(config.source, config.episodes, config.seed, ticks=config.ticks)
    return [load_stream(Path(config.source))]


def run_experiment(config: CommentaryConfig, out: Path, *, files: Sequence[Path] | None = None,
                   save_streams: bool = True, show_progress: bool | None = None,
                   ) -> Results[CommentaryConfig, CommentaryRow]:
    t0 = harness.begin(config)
    streams = load_streams(config, files)
    if config.limit:
        streams = streams[: config.limit]
    handle = None
    if any(m in MODEL_METHODS for m in config.methods):
        handle = harness.load_model(config.model, config.dtype)
        config.model_description = handle.description
    check_frames(config, handle, streams)
    if save_streams:
        for s in streams:
            save_stream(s, out / "streams")
    rows: list[CommentaryRow] = []
    jobs = [(s, m) for s in streams for m in config.methods]
    results = None
    with harness.progress(len(jobs), "streams", enabled=show_progress) as advance:
        for stream, method in jobs:
            done = asyncio.run(run_method(handle, stream, method, config))
            rows += tick_rows(stream, method, done, config)
            entry = config.streams.setdefault(stream.name, {
                "ticks": len(stream.ticks), "events": event_summary([stream]), "frames": {}})
            entry["frames"][method] = [done.seen, done.dropped]
            config.wall_s = time.perf_counter() - t0
            log.info("%s %s: %d seen, %d dropped", stream.name, method, done.seen, done.dropped)
            results = save(out, config, rows, final=False)
            advance(1)
    config.wall_s = time.perf_counter() - t0
    return save(out, config, rows, final=True) if jobs else results  # type: ignore[return-value]


def run(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    config = build_config(args)
    results = run_experiment(config, args.out, files=args.stream, save_streams=args.save_streams,
                             show_progress=args.progress)
    print(report(results))
    print(f"results: {args.out / 'results.json'}")
    return 0


EXPERIMENT = harness.Experiment(
    name=NAME,
    help="stream commentary: when to speak about a live stream (stream agent vs baselines)",
    description=__doc__.split("\n\n")[0] if __doc__ else "",
    configure=configure,
    run=run,
    default_max_tokens=16,
)
