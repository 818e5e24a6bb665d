"""Frame sources: ground truth at the right tick, determinism, and stream files that replay identically."""

from __future__ import annotations

import numpy as np
import pytest

from cothink.errors import InvalidParameterError
from cothink.experiments.streams import (
    SCENE_PX,
    GameVars,
    Scene,
    Shape,
    game_events,
    load_stream,
    procedural_stream,
    render_scene,
    save_stream,
)


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
    assert load_stream(save_stream(s, tmp_path)).same_as(s)
    assert vizdoom_stream("deadly_corridor", 0, skill=2, max_tics=140).same_as(s)  # deterministic
