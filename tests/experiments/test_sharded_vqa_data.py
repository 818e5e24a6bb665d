"""ShardedVQA data: exact answers, one fact tampered, determinism, files and pairs files that load back
identically, and malformed pairs files refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cothink.errors import InvalidParameterError
from cothink.experiments.sharded_vqa_data import (
    KINDS,
    VQA_PX,
    Question,
    load_pairs,
    load_vqa,
    main,
    make_item,
    save_pairs,
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
    assert main(["--seed", "3", "--count", "5", "--px", "96", "--out", str(tmp_path),
                 "--pairs-file-out", str(tmp_path / "pairs")]) == 0
    assert load_vqa(tmp_path / "sharded-vqa-3.jsonl").same_as(sharded_vqa(3, 5, px=96))
    assert len(load_pairs(tmp_path / "pairs" / "sharded-vqa-3.pairs.jsonl")) == 5
    printed = capsys.readouterr().out
    assert "sharded-vqa-3.jsonl" in printed and "sharded-vqa-3.pairs.jsonl" in printed
    with pytest.raises(InvalidParameterError):
        sharded_vqa(3, 0)


def test_pairs_file_round_trip_keeps_pixels_and_answers(tmp_path):
    data = sharded_vqa(6, 7, px=96)
    path = save_pairs(data, tmp_path / "held-out")
    pictures = (tmp_path / "held-out" / "sharded-vqa-6-images").iterdir()
    assert sorted(p.suffix for p in pictures) == [".png"] * 14
    pairs = load_pairs(path)
    assert [p.pair_id for p in pairs] == [it.id for it in data.items]
    for pair, it in zip(pairs, data.items, strict=True):
        assert (pair.question, pair.answer_correct, pair.answer_tampered) == (
            it.question.text(), it.answer, it.tampered_answer)
        assert pair.kind is None  # a pairs file carries no generated kind
        assert pair.image_correct.dtype == np.uint8 and np.array_equal(pair.image_correct, it.corrected)
        assert np.array_equal(pair.image_tampered, it.tampered)
    record = json.loads(path.read_text().splitlines()[0])
    assert set(record) == {"pair_id", "question", "answer_tampered", "answer_correct", "image_tampered",
                           "image_correct"}
    assert not record["image_correct"].startswith("/")  # relative to the file's folder


def _write_pairs(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(("edit", "message"), [
    (lambda r: r.pop("answer_correct"), "line 2: field 'answer_correct' is missing"),
    (lambda r: r.update(question=7), "line 2: field 'question' must be a non-empty string"),
    (lambda r: r.update(image_tampered="nowhere.png"), "line 2: image_tampered .*nowhere.png is not a file"),
    (lambda r: r.update(image_correct="notes.txt"), "line 2: image_correct .* is not a readable picture"),
    (lambda r: r.update(answer_tampered=r["answer_correct"]), "line 2: field 'answer_tampered' must differ"),
    (lambda r: r.update(pair_id="sharded-vqa-0-0"), "line 2: field 'pair_id' .* repeats"),
])
def test_a_malformed_pairs_line_is_refused_naming_line_and_field(tmp_path, edit, message):
    path = save_pairs(sharded_vqa(0, 3, px=64), tmp_path)
    (tmp_path / "notes.txt").write_text("not a picture")
    lines = path.read_text().splitlines()
    record = json.loads(lines[1])
    edit(record)
    _write_pairs(path, [lines[0], json.dumps(record), lines[2]])
    with pytest.raises(InvalidParameterError, match=message) as caught:
        load_pairs(path)
    assert caught.value.param == "pairs_file"


def test_pairs_files_that_are_not_json_lines_or_empty_are_refused(tmp_path):
    with pytest.raises(InvalidParameterError, match="line 1: not JSON"):
        load_pairs(_write_pairs(tmp_path / "a.jsonl", ["{oops"]))
    with pytest.raises(InvalidParameterError, match="line 1: expected a JSON object"):
        load_pairs(_write_pairs(tmp_path / "b.jsonl", ["[1, 2]"]))
    with pytest.raises(InvalidParameterError, match="holds no pairs"):
        load_pairs(_write_pairs(tmp_path / "c.jsonl", [""]))
    with pytest.raises(InvalidParameterError, match="no pairs file"):
        load_pairs(tmp_path / "missing.jsonl")
