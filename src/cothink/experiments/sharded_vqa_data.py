"""ShardedVQA input data: pictures with exact answers, each with a tampered twin that changes one fact.

The ShardedVQA experiment shows a model a tampered picture, lets it reason, and swaps in the corrected
picture mid-reasoning; a model that keeps watching its inputs answers from the corrected one. This
module makes that data, seeded and deterministic: the procedural scene of `streams` (coloured shapes
on an 8x8 board, a sign with a digit), drawn at ``px`` pixels (default 224), and a question whose
answer is computed from the scene, never written by hand.

Question kinds (`KINDS`, taken in turn, so a set of ``len(KINDS) * n`` items holds ``n`` of each):

- ``count-colour``: "How many red shapes are in the picture?"; the tampering recolours one shape into or
  out of the colour.
- ``count-shape``: "How many circles are in the picture?"; the tampering adds one of that shape (in a
  free cell) or removes one.
- ``colour``: "What colour is the triangle?" (the scene holds exactly one); the tampering recolours it.
- ``digit``: "What number is on the sign?"; the tampering changes the digit.
- ``sum``: "What is the number on the sign plus the number of blue shapes?"; the tampering changes the
  digit or recolours one shape, so the two facts to combine are one right and one wrong.

Each item holds the corrected scene and picture with their answer, and the tampered scene and picture
with theirs; the two scenes differ in exactly one fact (the digit, or one cell of the board), the two
answers always differ.

File format (replayable like a stream file), JSON Lines plus a numpy sidecar::

    {"format": "cothink-sharded-vqa", "version": 1, "name": "sharded-vqa-0", "seed": 0, "count": 50,
     "px": 224, "images": "sharded-vqa-0.npz"}                                         <- header
    {"id": "sharded-vqa-0-0", "kind": "count-colour", "target": "red", "question": "...",
     "answer": "2", "tampered_answer": "3", "change": "blue circle at (3,4) turned red",
     "scene": {"digit": 4, "shapes": [{"shape": "circle", "colour": "blue", "x": 3, "y": 4}, ...]},
     "tampered_scene": {...}}
    ...

The sidecar (``np.savez_compressed``) holds ``corrected`` and ``tampered``: uint8, ``(count, px, px, 3)``,
in item order. The same seed saves to the same bytes.

Pairs file (what the experiment reads; anyone can write one for a held-out set): JSON Lines, one pair a
line, ``{"pair_id", "question", "answer_tampered", "answer_correct", "image_tampered",
"image_correct"}``; the image fields are paths, relative to the file's folder, of pictures Pillow reads
(converted to RGB). :func:`save_pairs` writes a generated set as one (PNG pictures), :func:`load_pairs`
reads and checks one. ``python -m cothink.experiments.sharded_vqa_data`` writes a set in either form.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cothink.errors import InvalidParameterError
from cothink.experiments.streams import COLOURS, GRID, SHAPES, Scene, Shape, render_scene

FORMAT, VERSION = "cothink-sharded-vqa", 1
VQA_PX = 224  # default picture size: 28-pixel cells
KINDS = ("count-colour", "count-shape", "colour", "digit", "sum")
MIN_SHAPES, MAX_SHAPES = 3, 7


@dataclass(frozen=True)
class Question:
    """A question about a scene; its answer is a function of the scene."""

    kind: str  # one of KINDS
    target: str  # the colour (count-colour, sum) or shape (count-shape, colour) asked about; "" for digit

    def text(self) -> str:
        if self.kind == "count-colour":
            return f"How many {self.target} shapes are in the picture?"
        if self.kind == "count-shape":
            return f"How many {self.target}s are in the picture?"
        if self.kind == "colour":
            return f"What colour is the {self.target}?"
        if self.kind == "digit":
            return "What number is on the sign?"
        return f"What is the number on the sign plus the number of {self.target} shapes?"

    def answer(self, scene: Scene) -> str:
        """The exact answer for `scene`, as a word or a number."""
        if self.kind == "count-colour":
            return str(sum(s.colour == self.target for s in scene.shapes))
        if self.kind == "count-shape":
            return str(sum(s.shape == self.target for s in scene.shapes))
        if self.kind == "colour":
            (only,) = [s for s in scene.shapes if s.shape == self.target]
            return only.colour
        if self.kind == "digit":
            return str(scene.digit)
        return str(scene.digit + sum(s.colour == self.target for s in scene.shapes))


@dataclass(frozen=True, eq=False)
class VQAItem:
    id: str
    question: Question
    scene: Scene  # the corrected scene (ground truth)
    tampered_scene: Scene  # the same scene with one fact changed
    change: str  # what the tampering changed, in words (for reading the data, never shown to the model)
    corrected: np.ndarray  # uint8 (px, px, 3): the corrected picture
    tampered: np.ndarray  # uint8 (px, px, 3): the tampered picture

    @property
    def answer(self) -> str:
        return self.question.answer(self.scene)

    @property
    def tampered_answer(self) -> str:
        return self.question.answer(self.tampered_scene)


@dataclass(eq=False)
class VQASet:
    name: str
    seed: int
    px: int
    items: list[VQAItem]

    def same_as(self, other: VQASet) -> bool:
        """Same settings, questions, scenes and pictures."""
        if (self.name, self.seed, self.px) != (other.name, other.seed, other.px):
            return False
        if len(self.items) != len(other.items):
            return False
        return all(_same_item(a, b) for a, b in zip(self.items, other.items, strict=True))


def _same_item(a: VQAItem, b: VQAItem) -> bool:
    facts = (a.id, a.question, a.scene, a.tampered_scene, a.change)
    if facts != (b.id, b.question, b.scene, b.tampered_scene, b.change):
        return False
    return np.array_equal(a.corrected, b.corrected) and np.array_equal(a.tampered, b.tampered)


# ------------------------------------------------------------------------------------ generation


def _random_scene(rng: random.Random) -> Scene:
    scene = Scene(rng.randrange(10), [])
    for _ in range(rng.randint(MIN_SHAPES, MAX_SHAPES)):
        x, y = scene.free_cell(rng)
        scene.shapes.append(Shape(rng.choice(SHAPES), rng.choice(list(COLOURS)), x, y))
    return scene


def _question(kind: str, scene: Scene, rng: random.Random) -> Question | None:
    """A question of `kind` that `scene` can answer, or None when it cannot (draw another scene)."""
    if kind in ("count-colour", "sum"):
        return Question(kind, rng.choice(sorted({s.colour for s in scene.shapes})))
    if kind == "count-shape":
        return Question(kind, rng.choice(SHAPES))
    if kind == "colour":
        single = sorted(k for k in SHAPES if sum(s.shape == k for s in scene.shapes) == 1)
        return Question(kind, rng.choice(single)) if single else None
    return Question(kind, "")


def _recolour(scene: Scene, target: Shape, rng: random.Random, colour: str | None = None) -> str:
    index = scene.shapes.index(target)
    old = target.name()
    new = colour or rng.choice([c for c in COLOURS if c != target.colour])
    scene.shapes[index] = Shape(target.shape, new, target.x, target.y)
    return f"{old} at ({target.x},{target.y}) turned {new}"


def _change_digit(scene: Scene, rng: random.Random) -> str:
    old, scene.digit = scene.digit, rng.choice([d for d in range(10) if d != scene.digit])
    return f"sign changed {old} -> {scene.digit}"


def _tamper(question: Question, scene: Scene, rng: random.Random) -> str:
    """Change one fact of `scene` (in place) so that the answer to `question` changes; say what changed."""
    kind, target = question.kind, question.target
    if kind == "digit" or (kind == "sum" and rng.random() < 0.5):
        return _change_digit(scene, rng)
    if kind == "colour":
        (only,) = [s for s in scene.shapes if s.shape == target]
        return _recolour(scene, only, rng)
    if kind in ("count-colour", "sum"):
        inside = [s for s in scene.shapes if s.colour == target]
        outside = [s for s in scene.shapes if s.colour != target]
        if outside and rng.random() < 0.5:
            return _recolour(scene, rng.choice(outside), rng, target)
        return _recolour(scene, rng.choice(inside), rng)
    having = [s for s in scene.shapes if s.shape == target]  # count-shape
    if having and (len(scene.shapes) == GRID * (GRID - 1) or rng.random() < 0.5):
        gone = rng.choice(having)
        scene.shapes.remove(gone)
        return f"{gone.text()} removed"
    x, y = scene.free_cell(rng)
    new = Shape(target, rng.choice(list(COLOURS)), x, y)
    scene.shapes.append(new)
    return f"{new.text()} added"


def make_item(seed: int, index: int, px: int = VQA_PX) -> VQAItem:
    """Item `index` of the set `seed`: its kind is KINDS[index % len(KINDS)]; deterministic in both."""
    rng = random.Random(f"sharded-vqa:{seed}:{index}")
    kind = KINDS[index % len(KINDS)]
    question = None
    while question is None:
        scene = _random_scene(rng)
        question = _question(kind, scene, rng)
    tampered = copy.deepcopy(scene)
    change = _tamper(question, tampered, rng)
    if question.answer(tampered) == question.answer(scene):
        raise AssertionError(f"tampering {change!r} left the answer to {question.text()!r} unchanged")
    return VQAItem(f"sharded-vqa-{seed}-{index}", question, scene, tampered, change,
                   render_scene(scene, px), render_scene(tampered, px))


def sharded_vqa(seed: int, count: int, *, px: int = VQA_PX) -> VQASet:
    """`count` items (kinds in turn), deterministic in `seed`; each item depends only on (seed, index)."""
    if count < 1:
        raise InvalidParameterError(f"count must be >= 1, got {count}", param="count")
    return VQASet(f"sharded-vqa-{seed}", seed, px, [make_item(seed, i, px) for i in range(count)])


# ----------------------------------------------------------------------------------------- files


def _scene_json(scene: Scene) -> dict[str, Any]:
    shapes = [{"shape": s.shape, "colour": s.colour, "x": s.x, "y": s.y} for s in scene.shapes]
    return {"digit": scene.digit, "shapes": shapes}


def _scene_from(raw: dict[str, Any]) -> Scene:
    return Scene(int(raw["digit"]), [Shape(s["shape"], s["colour"], int(s["x"]), int(s["y"]))
                                     for s in raw["shapes"]])


def save_vqa(data: VQASet, folder: Path) -> Path:
    """Write `data` as ``folder/NAME.jsonl`` + ``NAME.npz`` (its pictures); returns the JSONL path."""
    folder.mkdir(parents=True, exist_ok=True)
    sidecar = f"{data.name}.npz"
    header = {"format": FORMAT, "version": VERSION, "name": data.name, "seed": data.seed,
              "count": len(data.items), "px": data.px, "images": sidecar}
    lines = [json.dumps(header)]
    for it in data.items:
        lines.append(json.dumps({
            "id": it.id, "kind": it.question.kind, "target": it.question.target,
            "question": it.question.text(), "answer": it.answer, "tampered_answer": it.tampered_answer,
            "change": it.change, "scene": _scene_json(it.scene),
            "tampered_scene": _scene_json(it.tampered_scene),
        }))
    path = folder / f"{data.name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    np.savez_compressed(folder / sidecar, corrected=np.stack([it.corrected for it in data.items]),
                        tampered=np.stack([it.tampered for it in data.items]))
    return path


def load_vqa(path: Path) -> VQASet:
    """Read a set written by :func:`save_vqa`. The stored answers must be the ones the stored scenes give."""
    path = Path(path)
    if not path.is_file():
        raise InvalidParameterError(f"no ShardedVQA file at {path}", param="data")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    header = json.loads(lines[0]) if lines else {}
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise InvalidParameterError(f"{path} is not a {FORMAT} v{VERSION} file", param="data")
    records = [json.loads(line) for line in lines[1:]]
    px = int(header["px"])
    with np.load(path.parent / header["images"]) as npz:
        corrected, tampered = npz["corrected"], npz["tampered"]
    shape = (len(records), px, px, 3)
    if len(records) != header["count"] or corrected.shape != shape or tampered.shape != shape:
        raise InvalidParameterError(f"{path}: {len(records)} items, header says {header['count']}, pictures "
                                    f"{corrected.shape} / {tampered.shape}", param="data")
    items = []
    for i, raw in enumerate(records):
        item = VQAItem(raw["id"], Question(raw["kind"], raw["target"]), _scene_from(raw["scene"]),
                       _scene_from(raw["tampered_scene"]), raw["change"], corrected[i], tampered[i])
        if (item.answer, item.tampered_answer) != (raw["answer"], raw["tampered_answer"]):
            raise InvalidParameterError(
                f"{path}: item {raw['id']}'s answers do not match its scenes", param="data")
        items.append(item)
    return VQASet(header["name"], int(header["seed"]), px, items)


# ------------------------------------------------------------------------------------- pairs files

PAIR_FIELDS = ("pair_id", "question", "answer_tampered", "answer_correct", "image_tampered", "image_correct")


@dataclass(frozen=True, eq=False)
class Pair:
    """One question with its corrected and tampered pictures, as the experiment runs it."""

    pair_id: str
    question: str
    answer_correct: str
    answer_tampered: str
    image_correct: np.ndarray  # uint8 (H, W, 3)
    image_tampered: np.ndarray  # uint8 (H, W, 3)
    kind: str | None = None  # the question kind of a generated item (KINDS); None for a pairs file's


def pair_of(item: VQAItem) -> Pair:
    return Pair(item.id, item.question.text(), item.answer, item.tampered_answer, item.corrected,
                item.tampered, item.question.kind)


def save_pairs(data: VQASet, folder: Path) -> Path:
    """Write `data` as a pairs file ``folder/NAME.pairs.jsonl`` with its pictures as PNG files in
    ``folder/NAME-images/``; returns the JSONL path."""
    from PIL import Image

    images = folder / f"{data.name}-images"
    images.mkdir(parents=True, exist_ok=True)
    lines = []
    for it in data.items:
        record = {"pair_id": it.id, "question": it.question.text(), "answer_tampered": it.tampered_answer,
                  "answer_correct": it.answer}
        for which, pixels in (("tampered", it.tampered), ("correct", it.corrected)):
            name = f"{data.name}-images/{it.id}-{which}.png"
            Image.fromarray(pixels, "RGB").save(folder / name)
            record[f"image_{which}"] = name
        lines.append(json.dumps(record))
    path = folder / f"{data.name}.pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _read_picture(path: Path, where: str, field: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise InvalidParameterError(f"{where}: {field} {path} is not a file", param="pairs_file")
    try:
        with Image.open(path) as picture:
            return np.asarray(picture.convert("RGB"), dtype=np.uint8).copy()
    except (UnidentifiedImageError, OSError) as e:
        raise InvalidParameterError(f"{where}: {field} {path} is not a readable picture ({e})",
                                    param="pairs_file") from e


def _pair_from(raw: Any, folder: Path, where: str) -> Pair:
    if not isinstance(raw, dict):
        raise InvalidParameterError(f"{where}: expected a JSON object, got {type(raw).__name__}",
                                    param="pairs_file")
    for field in PAIR_FIELDS:
        if field not in raw:
            raise InvalidParameterError(f"{where}: field {field!r} is missing", param="pairs_file")
        if not isinstance(raw[field], str) or not raw[field].strip():
            raise InvalidParameterError(f"{where}: field {field!r} must be a non-empty string, got "
                                        f"{raw[field]!r}", param="pairs_file")
    if raw["answer_correct"].strip().lower() == raw["answer_tampered"].strip().lower():
        raise InvalidParameterError(f"{where}: field 'answer_tampered' must differ from 'answer_correct'",
                                    param="pairs_file")
    return Pair(raw["pair_id"], raw["question"], raw["answer_correct"].strip(),
                raw["answer_tampered"].strip(),
                _read_picture(folder / raw["image_correct"], where, "image_correct"),
                _read_picture(folder / raw["image_tampered"], where, "image_tampered"))


def load_pairs(path: Path) -> list[Pair]:
    """Read a pairs file; a malformed line is refused with an error naming its line and field."""
    path = Path(path)
    if not path.is_file():
        raise InvalidParameterError(f"no pairs file at {path}", param="pairs_file")
    pairs: list[Pair] = []
    seen: set[str] = set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidParameterError(f"{where}: not JSON ({e})", param="pairs_file") from e
        pair = _pair_from(raw, path.parent, where)
        if pair.pair_id in seen:
            raise InvalidParameterError(f"{where}: field 'pair_id' {pair.pair_id!r} repeats an earlier line",
                                        param="pairs_file")
        seen.add(pair.pair_id)
        pairs.append(pair)
    if not pairs:
        raise InvalidParameterError(f"{path} holds no pairs", param="pairs_file")
    return pairs


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cothink.experiments.sharded_vqa_data``: write a ShardedVQA set."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m cothink.experiments.sharded_vqa_data",
        description="Write a seeded ShardedVQA set (questions, pictures, tampered twins).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=50, help=f"items, kinds in turn ({', '.join(KINDS)})")
    p.add_argument("--px", type=int, default=VQA_PX,
                   help=f"picture size, a multiple of {GRID} (default {VQA_PX})")
    p.add_argument("--out", type=Path, default=None, help="folder for NAME.jsonl + NAME.npz (with scenes)")
    p.add_argument("--pairs-file-out", type=Path, default=None,
                   help="folder for a pairs file NAME.pairs.jsonl + NAME-images/*.png (what the experiment's "
                        "--pairs-file reads)")
    args = p.parse_args(argv)
    if args.out is None and args.pairs_file_out is None:
        p.error("give --out, --pairs-file-out or both")
    data = sharded_vqa(args.seed, args.count, px=args.px)
    for folder, write in ((args.out, save_vqa), (args.pairs_file_out, save_pairs)):
        if folder is not None:
            print(write(data, folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
