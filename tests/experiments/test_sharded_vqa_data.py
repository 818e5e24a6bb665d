"""ShardedVQA data: exact answers, one fact tampered, determinism, and files that load back identically."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cothink.errors import InvalidParameterError
from cothink.experiments.sharded_vqa_data import (
    KINDS,
    VQA_PX,
    Question,
    load_vqa,
    main,
    make_item,
    save_vqa,
    sharded_vqa,
)
from cothink.experiments.streams import BACKGROUND, COLOURS, GRID, Scene, Shape, render_scene


def _cells(scene: Scene) -> dict[tuple[int, int], tuple[str, str]]:
    return {(s.x, s.y): (s.colour, s.shape) for s in scene.shapes}


def _changed_cells(a: np.ndarray, b: np.ndarray, px: int) -> set[tuple[int, int]]:
    cell = px // GRID
    diff = (a != b).any(axis=2)
    return {(x, y) for x in range(GRID) for y in range(GRID)
            if diff[y * cell : (y + 1) * cell, x * cell : (x + 1) * cell].any()}


def test_answers_are_computed_from_the_scene():
    shapes = [Shape("circle", "red", 1, 1), Shape("square", "red", 2, 2), Shape("circle", "blue", 3, 3)]
    scene = Scene(6, shapes)
    assert Question("count-colour", "red").answer(scene) == "2"
    assert Question("count-shape", "circle").answer(scene) == "2"
    assert Question("count-shape", "triangle").answer(scene) == "0"
    assert Question("colour", "square").answer(scene) == "red"
    assert Question("digit", "").answer(scene) == "6"
    assert Question("sum", "blue").answer(scene) == "7"
    assert Question("sum", "blue").text() == "What is the number on the sign plus the number of blue shapes?"


def test_tampered_picture_changes_one_fact_and_the_answer():
    data = sharded_vqa(seed=1, count=40)
    assert [it.question.kind for it in data.items[: len(KINDS)]] == list(KINDS)
    cell = VQA_PX // GRID
    for it in data.items:
        assert it.answer != it.tampered_answer, it.id
        assert np.array_equal(it.corrected, render_scene(it.scene, VQA_PX))
        assert np.array_equal(it.tampered, render_scene(it.tampered_scene, VQA_PX))
        before, after = _cells(it.scene), _cells(it.tampered_scene)
        changed = {c for c in before.keys() | after.keys() if before.get(c) != after.get(c)}
        digit_changed = it.scene.digit != it.tampered_scene.digit
        assert len(changed) + digit_changed == 1, it.id  # exactly one fact
        pixels = _changed_cells(it.corrected, it.tampered, VQA_PX)
        if digit_changed:
            assert pixels and pixels <= {(0, 0), (1, 0)} and "sign changed" in it.change
        else:
            assert pixels == changed, it.id
            ((x, y),) = changed
            region = it.tampered[y * cell : (y + 1) * cell, x * cell : (x + 1) * cell]
            if (x, y) in after:  # the cell shows the tampered shape in its colour
                colour = after[x, y][0]
                assert tuple(it.tampered[y * cell + cell // 2, x * cell + cell // 2]) == COLOURS[colour]
                assert f"({x},{y})" in it.change
            else:  # the shape was removed: bare ground
                assert (region == BACKGROUND).all()
        if it.question.kind == "colour":  # the question names a shape the scene holds exactly once
            assert sum(s.shape == it.question.target for s in it.scene.shapes) == 1


def test_items_are_deterministic_and_depend_on_seed_and_index_only():
    a, b = sharded_vqa(4, 12), sharded_vqa(4, 12)
    assert a.same_as(b)
    assert not a.same_as(sharded_vqa(5, 12))
    longer = sharded_vqa(4, 20)
    assert all(x.question == y.question and x.scene == y.scene for x, y in zip(a.items, longer.items))
    assert make_item(4, 7).tampered_scene == a.items[7].tampered_scene


def test_file_round_trip_is_bit_identical_and_same_bytes(tmp_path):
    data = sharded_vqa(2, 10, px=96)
    path = save_vqa(data, tmp_path / "a")
    again = load_vqa(path)
    assert again.same_as(data)
    assert again.items[3].corrected.dtype == np.uint8 and again.items[3].corrected.shape == (96, 96, 3)
    second = save_vqa(sharded_vqa(2, 10, px=96), tmp_path / "b")
    for suffix in (".jsonl", ".npz"):
        assert path.with_suffix(suffix).read_bytes() == second.with_suffix(suffix).read_bytes()
    lines = path.read_text().splitlines()
    record = json.loads(lines[1])
    assert record["question"] == data.items[0].question.text() and record["answer"] == data.items[0].answer
    # a file whose stored answer disagrees with its stored scene is refused
    record["answer"] = "wrong"
    path.write_text("\n".join([lines[0], json.dumps(record), *lines[2:]]) + "\n")
    with pytest.raises(InvalidParameterError, match="answers do not match"):
        load_vqa(path)
    path.write_text(path.read_text().replace('"version": 1', '"version": 2'))
    with pytest.raises(InvalidParameterError, match="not a cothink-sharded-vqa v1"):
        load_vqa(path)


def test_cli_writes_a_set(tmp_path, capsys):
    assert main(["--seed", "3", "--count", "5", "--px", "96", "--out", str(tmp_path)]) == 0
    assert load_vqa(tmp_path / "sharded-vqa-3.jsonl").same_as(sharded_vqa(3, 5, px=96))
    assert "sharded-vqa-3.jsonl" in capsys.readouterr().out
    with pytest.raises(InvalidParameterError):
        sharded_vqa(3, 0)
