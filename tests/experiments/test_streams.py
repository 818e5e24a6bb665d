"""Frame sources: ground truth at the right tick, determinism, and stream files that replay identically."""

from __future__ import annotations

import numpy as np
import pytest

from cothink.errors import InvalidParameterError
from cothink.experiments.streams import (
    BACKGROUND,
    COLOURS,
    GRID,
    PROCEDURAL_KINDS,
    SCENE_PX,
    GameVars,
    Scene,
    Shape,
    frame_groups,
    game_events,
    load_stream,
    procedural_stream,
    render_scene,
    save_stream,
)
from cothink.experiments.streams import main as streams_main


def test_procedural_change_is_at_its_tick():
    s = procedural_stream(seed=7, ticks=40)
    assert s.pixels is not None and s.pixels.shape == (40, SCENE_PX, SCENE_PX, 3)
    assert len(s.event_ticks) >= 3
    for t in range(1, len(s.ticks)):
        changed_text = s.ticks[t].text != s.ticks[t - 1].text
        changed_pixels = not np.array_equal(s.pixels[t], s.pixels[t - 1])
        # the scene changes exactly at the event ticks, in text and in pixels
        assert changed_text == bool(s.ticks[t].events), t
        assert changed_pixels == bool(s.ticks[t].events), t
    for t in s.event_ticks:
        (event,) = s.ticks[t].events
        if event.kind == "sign":
            new = event.detail.rsplit(" ", 1)[1]
            assert s.ticks[t].text.startswith(f"sign: {new}\n")
            assert not s.ticks[t - 1].text.startswith(f"sign: {new}\n")


def test_procedural_is_deterministic_and_seeded():
    a, b = procedural_stream(3, 30), procedural_stream(3, 30)
    assert a.same_as(b)
    assert not a.same_as(procedural_stream(4, 30))


def test_render_draws_each_shape_in_its_colour():
    scene = Scene(5, [Shape("square", "red", 3, 4)])
    img = render_scene(scene)
    cell = SCENE_PX // 8
    assert tuple(img[4 * cell + cell // 2, 3 * cell + cell // 2]) == (220, 40, 40)
    assert tuple(img[SCENE_PX - 2, 1]) == (128, 128, 128)


def test_game_events_from_variables():
    kw = dict(damage_min=10.0, critical_health=30.0)
    full = GameVars(100.0, 0.0, 0.0, False)
    assert game_events(full, GameVars(92.0, 0.0, 0.0, False), **kw) == []  # a small drain is no event
    kinds = [e.kind for e in game_events(full, GameVars(20.0, 1.0, 0.0, False), **kw)]
    assert kinds == ["damage", "kill", "critical"]
    healed = game_events(GameVars(50, 0, 0, False), GameVars(75, 0, 0, False), **kw)
    died = game_events(GameVars(20, 0, 0, False), GameVars(-5, 0, 0, True), **kw)
    assert [e.kind for e in healed] == ["item"] and [e.kind for e in died] == ["death"]


def test_stream_file_replays_identically(tmp_path):
    s = procedural_stream(11, 25)
    path = save_stream(s, tmp_path)
    assert path.name == "procedural-11.jsonl" and (tmp_path / "procedural-11.npz").exists()
    again = load_stream(path)
    assert again.same_as(s) and again.event_ticks == s.event_ticks
    text_only = procedural_stream(11, 25, pixels=False)
    assert load_stream(save_stream(text_only, tmp_path / "t")).pixels is None
    path.write_text(path.read_text().replace('"version": 1', '"version": 9'))
    with pytest.raises(InvalidParameterError, match="not a cothink-stream v1"):
        load_stream(path)


def test_vizdoom_event_appears_at_its_tick(tmp_path):
    pytest.importorskip("vizdoom")
    from cothink.experiments.streams import vizdoom_stream

    s = vizdoom_stream("deadly_corridor", 0, skill=2, max_tics=140)
    assert s.pixels is not None and s.pixels.shape[1:] == (120, 160, 3) and len(s.ticks) == s.pixels.shape[0]
    health = [float(t.text.split("| health ")[1].split(" ")[0]) for t in s.ticks]
    kinds = {t.tick: [e.kind for e in t.events] for t in s.ticks}
    assert any(kinds.values())
    for t in range(1, len(s.ticks)):  # the text observation shows each damage / item at its tick
        if "damage" in kinds[t]:
            assert health[t - 1] - health[t] >= 10
        if "item" in kinds[t]:
            assert health[t] > health[t - 1]
        if health[t - 1] - health[t] >= 10 and health[t] > 0:
            assert "damage" in kinds[t]
    path = save_stream(s, tmp_path)
    assert load_stream(path).same_as(s)
    again = vizdoom_stream("deadly_corridor", 0, skill=2, max_tics=140)
    assert again.same_as(s)  # deterministic
    path_again = save_stream(again, tmp_path / "again")
    for suffix in (".jsonl", ".npz"):
        assert path.with_suffix(suffix).read_bytes() == path_again.with_suffix(suffix).read_bytes()
    (group, *_) = frame_groups(s, 2, fps=5.0)
    assert group.frames.shape == (2, 120, 160, 3) and group.timestamp == 0.1


def _scene_cells(text: str) -> tuple[int, dict[tuple[int, int], str]]:
    """A procedural frame's text -> (digit on the sign, {(x, y): "colour shape"})."""
    sign, things = text.split("\n")
    cells = {}
    if things != "no shapes":
        for thing in things.split("; "):
            name, at = thing.split(" at ")
            x, y = at.strip("()").split(",")
            cells[int(x), int(y)] = name
    return int(sign.removeprefix("sign: ")), cells


def _changed_cells(before: np.ndarray, after: np.ndarray) -> set[tuple[int, int]]:
    cell = SCENE_PX // GRID
    diff = (before != after).any(axis=2)
    return {(x, y) for x in range(GRID) for y in range(GRID)
            if diff[y * cell : (y + 1) * cell, x * cell : (x + 1) * cell].any()}


def test_procedural_event_changes_the_pixels_it_names():
    # over several scenes: every event's frame differs from the one before exactly in the cells the event
    # names (the sign's two cells, or the cells a shape left / entered / changed colour in)
    seen_kinds = set()
    for seed in range(6):
        s = procedural_stream(seed, 60)
        assert s.pixels is not None
        for t in s.event_ticks:
            (event,) = s.ticks[t].events
            seen_kinds.add(event.kind)
            digit0, before = _scene_cells(s.ticks[t - 1].text)
            digit1, after = _scene_cells(s.ticks[t].text)
            changed = {c for c in before.keys() | after.keys() if before.get(c) != after.get(c)}
            expected = {"sign": 0, "appear": 1, "vanish": 1, "colour": 1, "move": 2}[event.kind]
            assert len(changed) == expected, (seed, t, event)
            assert (digit0 != digit1) == (event.kind == "sign")
            if event.kind == "sign":
                changed = {(0, 0), (1, 0)}
                assert _changed_cells(s.pixels[t - 1], s.pixels[t]) <= changed
                assert _changed_cells(s.pixels[t - 1], s.pixels[t])
            else:
                assert _changed_cells(s.pixels[t - 1], s.pixels[t]) == changed, (seed, t, event)
            if event.kind == "colour":
                ((x, y),) = changed
                assert before[x, y].split()[1] == after[x, y].split()[1]  # same shape, new colour
                assert event.detail.endswith(after[x, y].split()[0])
            cell = SCENE_PX // GRID
            for (x, y), name in after.items():  # every shape is drawn in its colour at its cell
                centre = s.pixels[t][y * cell + cell // 2, x * cell + cell // 2]
                assert tuple(centre) == COLOURS[name.split()[0]], (seed, t, name)
            empty = [(x, y) for x in range(GRID) for y in range(1, GRID) if (x, y) not in after]
            for x, y in empty:
                assert (s.pixels[t][y * cell : (y + 1) * cell, x * cell : (x + 1) * cell] == BACKGROUND).all()
    assert seen_kinds == set(PROCEDURAL_KINDS)


def test_stream_files_are_the_same_bytes_for_the_same_seed(tmp_path):
    first = save_stream(procedural_stream(5, 30), tmp_path / "a")
    second = save_stream(procedural_stream(5, 30), tmp_path / "b")
    for suffix in (".jsonl", ".npz"):
        assert first.with_suffix(suffix).read_bytes() == second.with_suffix(suffix).read_bytes()
    other = save_stream(procedural_stream(6, 30), tmp_path / "c")
    assert other.with_suffix(".npz").read_bytes() != first.with_suffix(".npz").read_bytes()
    again = load_stream(first)
    assert again.pixels is not None and again.pixels.dtype == np.uint8
    assert again.pixels.tobytes() == procedural_stream(5, 30).pixels.tobytes()  # bit for bit


def test_render_scene_scales_and_refuses_odd_sizes():
    scene = Scene(7, [Shape("circle", "blue", 2, 3)])
    big = render_scene(scene, 224)
    cell = 224 // GRID
    assert big.shape == (224, 224, 3) and big.dtype == np.uint8
    assert tuple(big[3 * cell + cell // 2, 2 * cell + cell // 2]) == COLOURS["blue"]
    assert (big[:cell, 2 * cell :] == BACKGROUND).all()  # the sign keeps to its two cells
    other_digit = render_scene(Scene(1, scene.shapes), 224)
    assert not np.array_equal(big[:cell, : 2 * cell], other_digit[:cell, : 2 * cell])
    assert np.array_equal(big[cell:], other_digit[cell:])
    with pytest.raises(InvalidParameterError, match="multiple of 8"):
        render_scene(scene, 100)


def test_frame_groups_cover_the_stream_with_the_processor_timestamps():
    from cothink.models.image_processing import group_timestamps

    s = procedural_stream(2, 7)
    assert s.pixels is not None
    groups = list(frame_groups(s, 2, fps=2.0))
    assert [g.ticks for g in groups] == [(0, 1), (2, 3), (4, 5), (6,)]
    assert [g.timestamp for g in groups] == [0.25, 1.25, 2.25, 3.0]
    assert [g.due for g in groups] == [0.5, 1.5, 2.5, 3.0]
    assert [g.timestamp for g in groups] == group_timestamps(range(7), 2.0, 2)
    for g in groups:
        assert np.array_equal(g.frames, s.pixels[g.ticks[0] : g.ticks[-1] + 1])
        assert g.events == tuple(e for t in g.ticks for e in s.ticks[t].events)
    assert [g.ticks for g in frame_groups(s, 2, fps=2.0, partial=False)] == [(0, 1), (2, 3), (4, 5)]
    late = list(frame_groups(s, 4, fps=4.0, start=1))
    assert [g.ticks for g in late] == [(1, 2, 3, 4), (5, 6)]
    assert [g.timestamp for g in late] == [0.625, 1.375]  # (5/4 + 6/4) / 2: the last frame fills the group
    assert sum(len(g.events) for g in frame_groups(procedural_stream(2, 40), 2, 2.0)) == len(
        procedural_stream(2, 40).event_ticks)
    with pytest.raises(InvalidParameterError, match="no pixel frames"):
        list(frame_groups(procedural_stream(2, 7, pixels=False), 2, 2.0))
    with pytest.raises(InvalidParameterError, match="temporal_patch_size"):
        list(frame_groups(s, 0, 2.0))


def test_record_cli_writes_replayable_streams(tmp_path, capsys):
    assert streams_main(["--count", "2", "--seed", "3", "--ticks", "12", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "procedural-3.jsonl", "procedural-3.npz", "procedural-4.jsonl", "procedural-4.npz"]
    assert load_stream(tmp_path / "procedural-4.jsonl").same_as(procedural_stream(4, 12))
    assert "events:" in capsys.readouterr().out
