"""Frame streams with exact event times, for the stream-commentary experiment.

A stream is a sequence of ticks; each tick is one frame, shown both as text (for text models) and as
pixels (for vision models), plus the ground-truth events that first become visible in that frame. Two
seeded, deterministic sources make them:

- :func:`procedural_stream`: a scene of coloured shapes and a sign with a digit. Between events the
  scene is still; an event changes exactly one thing: a shape appears or vanishes (the count changes),
  moves to another place, changes colour, or the digit on the sign changes. Rendered with PIL
  (``SCENE_PX`` square) and as text.
- :func:`vizdoom_stream`: a ViZDoom episode played by the scripted policy of `vizdoom_env`
  (``HeuristicPolicy``), one frame every ``tics_per_frame`` game tics: the screen buffer (RGB, 160x120)
  and the text observation of `vizdoom_env.Frame`; events from the game variables between two frames:
  ``damage`` (health fell by at least ``damage_min`` points), ``item`` (health rose, or the item count
  did), ``kill`` (the kill count rose), ``critical`` (health fell below ``critical_health``), ``death``.

Stream file format (one file per stream, replayable with ``--source FILE`` or ``--stream FILE``),
JSON Lines::

    {"format": "cothink-stream", "version": 1, "name": ..., "source": "procedural"|"vizdoom",
     "seed": 3, "ticks": 40, "params": {...}, "pixels": "NAME.npz"}          <- header
    {"tick": 0, "text": "sign: 4\\nred circle at (2,5)", "events": []}
    {"tick": 1, "text": "...", "events": [{"kind": "colour", "detail": "red circle turned blue"}]}
    ...

``pixels`` names a sidecar file next to it (numpy ``.npz``, array ``frames``: uint8, shape
``(ticks, height, width, 3)``), or is null for a text-only stream. A tick's time is ``tick / fps`` at
whatever rate the stream is played; the file holds no wall-clock times. Pixels load back bit for bit,
and the same stream saves to the same bytes (the zip entries carry the zip format's default date, not
the time of writing), so a seed names its files. ``python -m cothink.experiments.streams`` records
built-in streams without running an experiment.

:func:`frame_groups` cuts a stream's pixels into groups of a vision model's ``temporal_patch_size``
frames, each with its timestamp at a given frame rate, for ``engine.extend(block, frames=...,
timestamp=...)``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cothink.errors import InvalidParameterError
from cothink.experiments.vizdoom_env import SCENARIOS, DoomWorld, HeuristicPolicy, _vizdoom

FORMAT, VERSION = "cothink-stream", 1
SCENE_PX = 96  # procedural frames are SCENE_PX x SCENE_PX RGB
GRID = 8  # procedural positions are cells of an GRID x GRID board
SHAPES = ("circle", "square", "triangle")
BACKGROUND = (128, 128, 128)  # the ground of a procedural frame
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 230), "yellow": (235, 210, 40)}
PROCEDURAL_KINDS = ("appear", "vanish", "move", "colour", "sign")
VIZDOOM_KINDS = ("damage", "item", "kill", "critical", "death")


@dataclass(frozen=True)
class StreamEvent:
    kind: str  # one of PROCEDURAL_KINDS or VIZDOOM_KINDS
    detail: str  # what changed, in words (for reading a stream, never shown to the agent)


@dataclass(frozen=True)
class Tick:
    tick: int  # index in the stream
    text: str  # the frame as text
    events: tuple[StreamEvent, ...] = ()  # events first visible in this frame


@dataclass
class Stream:
    """One replayable stream: text frames, optional pixel frames, and its ground-truth events."""

    name: str
    source: str  # "procedural" | "vizdoom"
    seed: int
    ticks: list[Tick]
    pixels: np.ndarray | None = None  # uint8 (ticks, height, width, 3)
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def event_ticks(self) -> list[int]:
        """The ticks holding at least one event, in order."""
        return [t.tick for t in self.ticks if t.events]

    def texts(self) -> list[str]:
        return [t.text for t in self.ticks]

    def same_as(self, other: Stream) -> bool:
        """Same frames (text and pixels), events and settings."""
        if (self.name, self.source, self.seed, self.ticks, self.params) != (
            other.name, other.source, other.seed, other.ticks, other.params
        ):
            return False
        if self.pixels is None or other.pixels is None:
            return self.pixels is None and other.pixels is None
        return bool(np.array_equal(self.pixels, other.pixels))


# ----------------------------------------------------------------------------------------- files


def save_stream(stream: Stream, folder: Path) -> Path:
    """Write `stream` as ``folder/NAME.jsonl`` (+ ``NAME.npz`` with its pixels); returns the JSONL path."""
    folder.mkdir(parents=True, exist_ok=True)
    sidecar = f"{stream.name}.npz" if stream.pixels is not None else None
    header = {"format": FORMAT, "version": VERSION, "name": stream.name, "source": stream.source,
              "seed": stream.seed, "ticks": len(stream.ticks), "params": stream.params, "pixels": sidecar}
    lines = [json.dumps(header)]
    for t in stream.ticks:
        events = [{"kind": e.kind, "detail": e.detail} for e in t.events]
        lines.append(json.dumps({"tick": t.tick, "text": t.text, "events": events}))
    path = folder / f"{stream.name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    if sidecar is not None:
        np.savez_compressed(folder / sidecar, frames=stream.pixels)
    return path


def load_stream(path: Path) -> Stream:
    """Read a stream file written by :func:`save_stream` (its pixels too, when it names a sidecar)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidParameterError(f"no stream file at {path}", param="source")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    header = json.loads(lines[0]) if lines else {}
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise InvalidParameterError(f"{path} is not a {FORMAT} v{VERSION} file", param="source")
    ticks = []
    for i, line in enumerate(lines[1:]):
        raw = json.loads(line)
        if raw["tick"] != i:
            raise InvalidParameterError(f"{path}: tick {raw['tick']} at position {i}", param="source")
        events = tuple(StreamEvent(e["kind"], e["detail"]) for e in raw["events"])
        ticks.append(Tick(i, raw["text"], events))
    if len(ticks) != header["ticks"]:
        raise InvalidParameterError(
            f"{path}: {len(ticks)} ticks, header says {header['ticks']}", param="source")
    pixels = None
    if header.get("pixels"):
        with np.load(path.parent / header["pixels"]) as npz:
            pixels = npz["frames"]
        if pixels.shape[0] != len(ticks) or pixels.dtype != np.uint8:
            raise InvalidParameterError(
                f"{header['pixels']}: frames {pixels.shape} do not match", param="source")
    return Stream(header["name"], header["source"], header["seed"], ticks, pixels, header.get("params", {}))


# ------------------------------------------------------------------------------------ procedural


@dataclass
class Shape:
    shape: str  # one of SHAPES
    colour: str  # a key of COLOURS
    x: int  # cell column, 0..GRID-1
    y: int  # cell row, 1..GRID-1 (row 0 holds the sign)

    def name(self) -> str:
        return f"{self.colour} {self.shape}"

    def text(self) -> str:
        return f"{self.name()} at ({self.x},{self.y})"


@dataclass
class Scene:
    """The procedural scene's state: the digit on the sign and the shapes, in the order they appeared."""

    digit: int
    shapes: list[Shape]

    def text(self) -> str:
        things = "; ".join(s.text() for s in self.shapes) or "no shapes"
        return f"sign: {self.digit}\n{things}"

    def free_cell(self, rng: random.Random) -> tuple[int, int]:
        taken = {(s.x, s.y) for s in self.shapes}
        cells = [(x, y) for x in range(GRID) for y in range(1, GRID) if (x, y) not in taken]
        return rng.choice(cells)


def render_scene(scene: Scene, px: int = SCENE_PX) -> np.ndarray:
    """The scene in pixels: uint8 (px, px, 3), grey ground, the sign in the top-left two cells (its digit
    in Pillow's default font, 10 points at the default size, scaled with the cell). `px` is a multiple
    of GRID, at least 8 * GRID."""
    from PIL import Image, ImageDraw, ImageFont

    if px % GRID or px < 8 * GRID:
        raise InvalidParameterError(
            f"px must be a multiple of {GRID}, at least {8 * GRID}; got {px}", param="px")
    cell = px // GRID
    img = Image.new("RGB", (px, px), BACKGROUND)
    draw = ImageDraw.Draw(img)
    draw.rectangle([1, 1, 2 * cell - 2, cell - 2], fill=(255, 255, 255), outline=(0, 0, 0))
    font = ImageFont.load_default(size=cell * 5 // 6)
    draw.text((cell - cell // 4, 0), str(scene.digit), fill=(0, 0, 0), font=font)
    for s in scene.shapes:
        x0, y0 = s.x * cell + 1, s.y * cell + 1
        box = [x0, y0, x0 + cell - 3, y0 + cell - 3]
        colour = COLOURS[s.colour]
        if s.shape == "circle":
            draw.ellipse(box, fill=colour)
        elif s.shape == "square":
            draw.rectangle(box, fill=colour)
        else:
            draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=colour)
    return np.asarray(img, dtype=np.uint8)


def _procedural_event(scene: Scene, rng: random.Random, max_shapes: int) -> StreamEvent:
    """Change one thing in `scene` (in place) and say what changed."""
    kinds = ["sign", "colour", "move"] if scene.shapes else ["sign"]
    if len(scene.shapes) < max_shapes:
        kinds.append("appear")
    if len(scene.shapes) > 1:
        kinds.append("vanish")
    kind = rng.choice(kinds)
    if kind == "sign":
        old, scene.digit = scene.digit, rng.choice([d for d in range(10) if d != scene.digit])
        return StreamEvent(kind, f"sign changed {old} -> {scene.digit}")
    if kind == "appear":
        x, y = scene.free_cell(rng)
        new = Shape(rng.choice(SHAPES), rng.choice(list(COLOURS)), x, y)
        scene.shapes.append(new)
        return StreamEvent(kind, f"{new.text()} appeared")
    target = rng.choice(scene.shapes)
    if kind == "vanish":
        scene.shapes.remove(target)
        return StreamEvent(kind, f"{target.text()} vanished")
    if kind == "colour":
        old = target.name()
        target.colour = rng.choice([c for c in COLOURS if c != target.colour])
        return StreamEvent(kind, f"{old} turned {target.colour}")
    before = (target.x, target.y)
    target.x, target.y = scene.free_cell(rng)
    return StreamEvent(kind, f"{target.name()} moved {before} -> ({target.x},{target.y})")


def procedural_stream(
    seed: int,
    ticks: int = 40,
    *,
    min_gap: int = 3,
    max_gap: int = 9,
    max_shapes: int = 5,
    pixels: bool = True,
) -> Stream:
    """A still scene with one change every `min_gap`..`max_gap` ticks (uniform, seeded); the first event
    comes after at least `min_gap` ticks. Deterministic in `seed`."""
    if not 1 <= min_gap <= max_gap or ticks < 1:
        raise InvalidParameterError("need ticks >= 1 and 1 <= min_gap <= max_gap", param="ticks")
    rng = random.Random(seed)
    scene = Scene(rng.randrange(10), [])
    for _ in range(2):
        x, y = scene.free_cell(rng)
        scene.shapes.append(Shape(rng.choice(SHAPES), rng.choice(list(COLOURS)), x, y))
    out: list[Tick] = []
    frames: list[np.ndarray] = []
    next_event = rng.randint(min_gap, max_gap)
    for t in range(ticks):
        events: tuple[StreamEvent, ...] = ()
        if t == next_event:
            events = (_procedural_event(scene, rng, max_shapes),)
            next_event = t + rng.randint(min_gap, max_gap)
        out.append(Tick(t, scene.text(), events))
        if pixels:
            frames.append(render_scene(scene))
    params = {"min_gap": min_gap, "max_gap": max_gap, "max_shapes": max_shapes}
    return Stream(f"procedural-{seed}", "procedural", seed, out,
                  np.stack(frames) if pixels else None, params)


# --------------------------------------------------------------------------------------- vizdoom


@dataclass(frozen=True)
class GameVars:
    """The game variables events are read from, at one frame."""

    health: float
    kills: float
    items: float
    dead: bool


def game_events(before: GameVars, after: GameVars, *, damage_min: float, critical_health: float) -> list[
    StreamEvent
]:
    """The events between two frames' game variables (pure: the rules of `vizdoom_stream`)."""
    events = []
    if after.dead and not before.dead:
        return [StreamEvent("death", f"the player died (health {after.health:.0f})")]
    if before.health - after.health >= damage_min:
        events.append(StreamEvent("damage", f"health {before.health:.0f} -> {after.health:.0f}"))
    if after.health > before.health or after.items > before.items:
        detail = f"picked up an item (health {before.health:.0f} -> {after.health:.0f})"
        events.append(StreamEvent("item", detail))
    if after.kills > before.kills:
        detail = f"killed {after.kills - before.kills:.0f} enemy (total {after.kills:.0f})"
        events.append(StreamEvent("kill", detail))
    if after.health < critical_health <= before.health:
        events.append(StreamEvent("critical", f"health critical ({after.health:.0f})"))
    return events


class RecordingWorld(DoomWorld):
    """A `vizdoom_env.DoomWorld` that also reads the screen buffer and the game variables events come from."""

    def variables(self) -> GameVars:
        var = _vizdoom().GameVariable
        game = self._game
        return GameVars(
            float(game.get_game_variable(var.HEALTH)),
            float(game.get_game_variable(var.KILLCOUNT)),
            float(game.get_game_variable(var.ITEMCOUNT)),
            bool(game.is_player_dead()),
        )

    def screen(self) -> np.ndarray | None:
        """The current screen, uint8 (height, width, 3); None once the episode has ended."""
        state = None if self.finished else self._game.get_state()
        if state is None or state.screen_buffer is None:
            return None
        buf = np.asarray(state.screen_buffer, dtype=np.uint8)
        return np.ascontiguousarray(buf.transpose(1, 2, 0)) if buf.shape[0] == 3 else buf

    def set_skill(self, skill: int) -> None:
        """Play at difficulty `skill` (1-5) from a fresh episode on."""
        self._game.set_doom_skill(skill)
        self.reset()


def vizdoom_stream(
    scenario: str,
    seed: int,
    *,
    tics_per_frame: int = 7,
    max_tics: int = 525,
    damage_min: float = 10.0,
    critical_health: float = 30.0,
    skill: int | None = None,
    pixels: bool = True,
) -> Stream:
    """One episode of `scenario` played by the scripted policy, a frame every `tics_per_frame` tics,
    until the player dies or `max_tics` pass. `skill` (1-5) overrides the scenario's difficulty. The
    frame after the death is the last. Deterministic in `seed` (the game and the policy are)."""
    if scenario not in SCENARIOS:
        raise InvalidParameterError(
            f"unknown scenario {scenario!r}; one of {sorted(SCENARIOS)}", param="scenario")
    sc = SCENARIOS[scenario]
    policy = HeuristicPolicy(sc)
    world = RecordingWorld(sc, seed=seed, max_tics=max_tics)
    if skill is not None:
        world.set_skill(skill)
    ticks: list[Tick] = []
    frames: list[np.ndarray] = []
    last_screen: np.ndarray | None = None
    try:
        before = world.variables()
        while True:
            frame = world.observe()
            after = world.variables()
            events = game_events(before, after, damage_min=damage_min, critical_health=critical_health)
            if world.finished and not after.dead and not events:
                break  # the episode timed out: nothing new to show
            ticks.append(Tick(len(ticks), frame.text(), tuple(events)))
            if pixels:
                screen = world.screen()
                last_screen = screen if screen is not None else last_screen
                frames.append(last_screen if last_screen is not None else np.zeros((120, 160, 3), np.uint8))
            if world.finished:
                break
            before = after
            world.act(policy(frame))
            world.advance(tics_per_frame)
    finally:
        world.close()
    params = {"scenario": scenario, "tics_per_frame": tics_per_frame, "max_tics": max_tics,
              "damage_min": damage_min, "critical_health": critical_health, "skill": skill}
    return Stream(f"vizdoom-{scenario}-{seed}", "vizdoom", seed, ticks,
                  np.stack(frames) if pixels else None, params)


def streams_for(source: str, count: int, seed: int, *, ticks: int, pixels: bool = True) -> list[Stream]:
    """`count` streams of a built-in source: procedural (seeds seed, seed+1, ...) or vizdoom (alternating
    deadly_corridor at skill 2 and health_gathering, one seed each)."""
    if source == "procedural":
        return [procedural_stream(seed + i, ticks, pixels=pixels) for i in range(count)]
    if source == "vizdoom":
        out = []
        for i in range(count):
            scenario, skill = (("deadly_corridor", 2), ("health_gathering", None))[i % 2]
            out.append(vizdoom_stream(scenario, seed + i, max_tics=7 * ticks, skill=skill, pixels=pixels))
        return out
    raise InvalidParameterError(f"unknown source {source!r}", param="source")


def event_summary(streams: Sequence[Stream]) -> dict[str, int]:
    """How many events of each kind the streams hold."""
    counts: dict[str, int] = {}
    for s in streams:
        for t in s.ticks:
            for e in t.events:
                counts[e.kind] = counts.get(e.kind, 0) + 1
    return counts


# ---------------------------------------------------------------------------------- frame groups


@dataclass(frozen=True, eq=False)
class PixelGroup:
    """Consecutive pixel frames of a stream, as one frame group for a vision model's temporal patch."""

    ticks: tuple[int, ...]  # the stream ticks of the frames, consecutive; 1..temporal_patch_size of them
    frames: np.ndarray  # uint8 (len(ticks), height, width, 3): the stream's pixels at those ticks
    timestamp: float  # seconds: the mean time of the first and last frame (the group's timestamp text)
    due: float  # seconds: when the last frame is shown, the earliest a live reader holds the whole group
    events: tuple[StreamEvent, ...]  # ground truth: the events first visible in these ticks


def frame_groups(
    stream: Stream, temporal_patch_size: int, fps: float, *, start: int = 0, partial: bool = True
) -> Iterator[PixelGroup]:
    """The stream's pixel frames from tick `start` on, in groups of `temporal_patch_size`, tick i shown at
    ``i / fps`` seconds. Each group holds what one frame group of ``engine.extend(block, frames=...,
    timestamp=...)`` (and `cothink.models.image_processing.preprocess_frames`) takes; its timestamp
    follows the video processor's rule (`cothink.models.image_processing.group_timestamps`), which also
    holds for a short last group (the processor fills it by repeating its last frame). `partial=False`
    leaves a short last group out."""
    from cothink.models.image_processing import group_timestamps

    if stream.pixels is None:
        raise InvalidParameterError(f"stream {stream.name} has no pixel frames", param="stream")
    if temporal_patch_size < 1 or not fps > 0 or not 0 <= start <= len(stream.ticks):
        raise InvalidParameterError(
            f"need temporal_patch_size >= 1, fps > 0 and 0 <= start <= {len(stream.ticks)}", param="frames")
    for first in range(start, len(stream.ticks), temporal_patch_size):
        ticks = tuple(range(first, min(first + temporal_patch_size, len(stream.ticks))))
        if len(ticks) < temporal_patch_size and not partial:
            return
        (timestamp,) = group_timestamps(ticks, fps, temporal_patch_size)
        events = tuple(e for t in ticks for e in stream.ticks[t].events)
        yield PixelGroup(ticks, stream.pixels[first : ticks[-1] + 1], timestamp, ticks[-1] / fps, events)


# ------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cothink.experiments.streams``: record built-in streams as stream files."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m cothink.experiments.streams",
        description="Record seeded streams (procedural scenes or ViZDoom episodes) as stream files.")
    p.add_argument("--source", choices=("procedural", "vizdoom"), default="procedural")
    p.add_argument("--count", type=int, default=1, help="streams to record, seeds --seed, --seed+1, ...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ticks", type=int, default=40, help="frames per stream (most, for vizdoom)")
    p.add_argument("--pixels", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the pixel frames (default on)")
    p.add_argument("--out", type=Path, required=True, help="folder for NAME.jsonl (+ NAME.npz)")
    args = p.parse_args(argv)
    streams = streams_for(args.source, args.count, args.seed, ticks=args.ticks, pixels=args.pixels)
    for s in streams:
        print(f"{save_stream(s, args.out)}: {len(s.ticks)} ticks, events at {s.event_ticks}")
    print("events:", event_summary(streams))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
