"""Image and video blocks through the engine, against transformers' Qwen3.5 multimodal model (fp32).

Blocks holding text, images of different shapes, clips and live frame groups, written one after
another, read as one sequence: logits and greedy tokens equal transformers' forward on the blocks'
tokens concatenated (its own get_rope_index positions, its own placement of the tower's features).
One-layer models (a block's memory does not depend on its view) read through views in any order equal
the reference on the tokens concatenated in view order, and an image swapped under a later block moves
that block by the span difference without touching its keys. Bad input is refused with the block left
as it was; the vision tower's work is scheduled one image or frame group per step.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch
from PIL import Image

from support import tiny_vision_folder

import cothink
from cothink.errors import EngineClosedError, InvalidParameterError
from cothink.execution.step import StepItem
from cothink.models.image_processing import preprocess_frames, preprocess_image, preprocess_video
from cothink.scheduler.policy import PriorityClass, encode_step_patch_blocks

TOL = 1e-4  # fp32 logits over a whole multimodal sequence (transformers rotates at absolute positions)
IMAGE, VIDEO, VS, VE = 296, 297, 298, 299
BANNED = [IMAGE, VIDEO, VS, VE]


@pytest.fixture(scope="module")
def folders():
    return tiny_vision_folder


def _image(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _run(coro):
    return asyncio.run(coro)


class Reference:
    """transformers' multimodal forward on blocks' tokens concatenated: pixels in order of appearance."""

    def __init__(self, tm, runner):
        self.tm, self.vision = tm, runner.vision
        self.images: dict[int, list] = {}  # block id -> preprocessed images / groups in order

    def note(self, block, pixels: list) -> None:
        self.images.setdefault(block.id, []).extend(pixels)

    @torch.no_grad()
    def logits(self, view: list, extra: list[int] = ()) -> torch.Tensor:
        ids = [t for b in view for t in b.tokens] + list(extra)
        pixels = [p for b in view for p in self.images.get(b.id, [])]
        types = [1 if t == IMAGE else 2 if t == VIDEO else 0 for t in ids]
        kw: dict = {}
        images = [p for p in pixels if not hasattr(p, "timestamp")]
        groups = [p for p in pixels if hasattr(p, "timestamp")]
        if images:
            kw.update(pixel_values=torch.cat([p.pixel_values for p in images]),
                      image_grid_thw=torch.tensor([[1, p.grid.h, p.grid.w] for p in images]))
        if groups:
            kw.update(pixel_values_videos=torch.cat([p.pixel_values for p in groups]),
                      video_grid_thw=torch.tensor([[1, p.grid.h, p.grid.w] for p in groups]))
        out = self.tm.ref(input_ids=torch.tensor([ids]), mm_token_type_ids=torch.tensor([types]),
                          use_cache=False, **kw)
        return out.logits[0].float()

    def greedy(self, view: list, n: int) -> tuple[list[int], torch.Tensor]:
        """n greedy tokens (placeholder ids banned) by full recomputation; their log-probabilities."""
        out, rows = [], []
        for _ in range(n):
            row = self.logits(view, out)[-1]
            rows.append(torch.log_softmax(row, -1))
            masked = row.clone()
            masked[BANNED] = -float("inf")
            out.append(int(masked.argmax()))
        return out, torch.stack(rows)


async def _write_sequence(engine, ref: Reference, chunks: list[tuple[str, object]]) -> list:
    """Each (kind, value) into its own block, read after every block before it."""
    vision = engine.runner.vision
    view = []
    for i, (kind, value) in enumerate(chunks):
        block = engine.block(f"b{i}")
        view.append(block)
        if kind == "text":
            await engine.extend(block, token_ids=value, view=list(view))
        elif kind == "image":
            await engine.extend(block, image=value, view=list(view))
            ref.note(block, [preprocess_image(value, vision.image)])
        elif kind == "video":
            await engine.extend(block, video=value, view=list(view))
            ref.note(block, preprocess_video(value, vision.video))
        else:  # a live stream: frame groups appended to one block
            for t, group in enumerate(value):
                await engine.extend(block, frames=group, timestamp=0.5 * t, view=list(view))
                ref.note(block, [preprocess_frames(group, 0.5 * t, vision.video)])
    return view


SEQUENCE = [
    ("text", [5, 6, 7]),
    ("image", _image(40, 16, 1)),  # tall: 5 x 2 merged tokens
    ("text", [8, 9]),
    ("image", _image(12, 44, 2)),  # wide
    ("video", [_image(30, 20, 3 + i) for i in range(4)]),  # two frame groups
    ("frames", [[_image(24, 24, 10), _image(24, 24, 11)], [_image(24, 24, 12)]]),
    ("text", [10, 11]),
]


@pytest.mark.parametrize("model,backend,patch_blocks", [
    ("qwen35_vl", "torch", 2048), ("qwen35_vl", "native", 2048), ("qwen3_vl", "native", 2048),
    ("qwen3_vl", "torch", 1)])
def test_sequential_blocks_equal_transformers(folders, tiny_model, model, backend, patch_blocks,
                                              record_error):
    """Text, tall and wide images, a clip and a live stream in blocks written one after another
    (prefill chunks of 3 tokens: chunk boundaries fall inside images), then a greedy generation with
    log-probabilities: every token and log-probability equals transformers on the whole sequence.
    Qwen3-VL adds its DeepStack features after the first decoder layers; with a budget of one
    patch-block its tower stops inside blocks, a few rows a step."""
    if backend == "native" and not cothink.ops.native.available():
        pytest.skip("native kernels unavailable")
    engine = cothink.Engine.from_pretrained(folders(model), max_prefill_chunk=3,
                                            attention_backend=backend, vision_step_patch_blocks=patch_blocks)
    ref = Reference(tiny_model(model), engine.runner)

    async def main():
        async with engine:
            view = await _write_sequence(engine, ref, SEQUENCE)
            # six images and frame groups, in one step each, or a few rows of a block's phase a step
            ran = [it.patch_blocks for s in engine.timeline for it in s.items if it.kind == "encode"]
            depth = engine.runner.vision.tower.depth
            assert (len(ran) > 6 * 2 * depth) if patch_blocks == 1 else (len(ran) == 6)
            assert min(ran) > 0 and max(ran) <= patch_blocks or patch_blocks == 1 and max(ran) == 1
            spans = sum(b.position_span for b in view)
            tokens = sum(len(b) for b in view)
            assert spans < tokens  # an image spans max(rows, cols) positions, not its token count
            p = await engine.probe(view, [12, 13], [" yes", " no"])
            out = engine.block("out")
            gen = engine.generate([*view, out], max_tokens=6, banned_token_ids=BANNED, logprobs=3,
                                  stop_at_eos=False)
            pieces = [piece async for piece in gen]
            return view, out, p, pieces

    view, out, p, pieces = _run(main())
    want, logps = ref.greedy(view, 6)
    assert [t for piece in pieces for t in piece.token_ids] == want
    assert out.tokens == want
    # the probe's answer: the logits after its question
    row = torch.log_softmax(ref.logits(view, [12, 13])[-1], -1)
    yes, no = float(row[256].exp()), float(row[257].exp())
    assert abs(p[" yes"] - yes / (yes + no)) < TOL
    # every generated token's log-probability and its top alternatives, as the reference's
    got = [lp for piece in pieces for lp in piece.logprobs]
    for lp, row in zip(got, logps, strict=True):
        assert abs(lp.logprob - float(row[lp.token_id])) < TOL
        for token, logprob in lp.top:
            assert abs(logprob - float(row[token])) < TOL
    record_error("vision, sequential", f"{model} {backend}",
                 max(abs(lp.logprob - float(row[lp.token_id])) for lp, row in zip(got, logps)))


def test_logprobs_and_logits_equal_transformers(folders, tiny_model, record_error):
    """The engine's per-token logits over a view of image blocks (runner.step, 'all' rows) equal the
    reference's rows for the same tokens."""
    engine = cothink.Engine.from_pretrained(folders("qwen35_vl"), max_prefill_chunk=4)
    ref = Reference(tiny_model("qwen35_vl"), engine.runner)

    async def main():
        async with engine:
            return await _write_sequence(engine, ref, SEQUENCE[:5])

    view = _run(main())
    tail = engine.runner.new_block("tail")
    got = engine.runner.step([StepItem(tail, [20, 21, 22], [*view, tail], "all")])[0]
    want = ref.logits(view, [20, 21, 22])[-3:]
    assert record_error("vision, sequential", "qwen35_vl", float((got - want).abs().max())) < TOL


# ---- one layer: views in any order ----------------------------------------------------------------
def _one_layer_blocks(engine, ref):
    """Blocks written alone (each its own view): text, an image with text after it in the same block,
    a wide image, a clip of two groups, a block ending on an image, text."""
    vision = engine.runner.vision

    async def main():
        async with engine:
            blocks = [engine.block(f"b{i}") for i in range(6)]
            a, i1, i2, v, k, c = blocks
            await engine.extend(a, token_ids=[5, 6, 7, 8])
            img = _image(40, 16, 1)
            await engine.extend(i1, token_ids=[9])
            await engine.extend(i1, image=img)
            await engine.extend(i1, token_ids=[10, 11])
            ref.note(i1, [preprocess_image(img, vision.image)])
            wide = _image(12, 44, 2)
            await engine.extend(i2, image=wide)
            ref.note(i2, [preprocess_image(wide, vision.image)])
            clip = [_image(30, 20, 3 + j) for j in range(4)]
            await engine.extend(v, video=clip)
            ref.note(v, preprocess_video(clip, vision.video))
            square = _image(24, 24, 9)
            await engine.extend(k, token_ids=[12])
            await engine.extend(k, image=square)
            ref.note(k, [preprocess_image(square, vision.image)])
            await engine.extend(c, token_ids=[13, 14, 15])
            return blocks

    return _run(main())


@pytest.mark.parametrize("model", ["qwen35_vl_1l", "qwen35_vl_1l_linear"])
def test_one_layer_views_in_random_orders(folders, tiny_model, model, record_error):
    """Full attention (3-D positions, spans) and Gated DeltaNet (image features through the state
    composition of views) alone."""
    engine = cothink.Engine.from_pretrained(folders(model))
    ref = Reference(tiny_model(model), engine.runner)
    blocks = _one_layer_blocks(engine, ref)
    rng = random.Random(0)
    worst = 0.0
    for trial in range(8):
        order = rng.sample(blocks, k=rng.randint(2, len(blocks)))
        tail = engine.runner.new_block(f"tail{trial}")
        got = engine.runner.step([StepItem(tail, [20, 21], [*order, tail], "all")])[0]
        want = ref.logits(order, [20, 21])[-2:]
        worst = max(worst, float((got - want).abs().max()))
        engine.runner.free(tail)
    assert record_error("vision, one layer views", model, worst) < TOL


@pytest.mark.parametrize("same_size", [True, False])
def test_swapped_image_moves_later_blocks_by_the_span_difference(folders, tiny_model, same_size):
    """[ctx, bad, thoughts] -> [ctx, good, thoughts]: thoughts (written while the bad image was
    visible) moves by span(good) - span(bad), its stored keys are not rewritten, and in one layer the
    swapped view equals transformers on [ctx, good, thoughts]."""
    engine = cothink.Engine.from_pretrained(folders("qwen35_vl_1l"))
    ref = Reference(tiny_model("qwen35_vl_1l"), engine.runner)
    vision = engine.runner.vision
    bad_px = _image(24, 24, 1)
    good_px = _image(24, 24, 2) if same_size else _image(40, 16, 2)

    async def main():
        async with engine:
            ctx, bad, good, thoughts = (engine.block(n) for n in ("ctx", "bad", "good", "thoughts"))
            await engine.extend(ctx, token_ids=[5, 6, 7])
            await engine.extend(bad, image=bad_px, view=[ctx, bad])
            await engine.extend(good, image=good_px, view=[ctx, good])
            await engine.extend(thoughts, token_ids=[8, 9, 10, 11], view=[ctx, bad, thoughts])
            return ctx, bad, good, thoughts

    ctx, bad, good, thoughts = _run(main())
    ref.note(bad, [preprocess_image(bad_px, vision.image)])
    ref.note(good, [preprocess_image(good_px, vision.image)])
    store = engine.runner.store
    slots = store.slots(thoughts, 0, len(thoughts))
    keys = store.pool.k[:, slots].clone()
    assert (good.position_span == bad.position_span) == same_size
    tail = engine.runner.new_block("tail")
    got = engine.runner.step([StepItem(tail, [20], [ctx, good, thoughts, tail], "all")])[0]
    assert torch.equal(store.pool.k[:, slots], keys)  # nothing re-rotated
    want = ref.logits([ctx, good, thoughts], [20])[-1:]
    assert float((got - want).abs().max()) < TOL
    # the thoughts' own logits under the new view, recomputed: equal to the reference's rows too
    peek = engine.runner.new_block("peek")
    got = engine.runner.step([StepItem(peek, thoughts.tokens[-1:], [ctx, good, thoughts, peek], "last",
                                       [len(ctx), len(good), len(thoughts) - 1])])[0]
    want = ref.logits([ctx, good, thoughts])[-1:]
    assert float((got - want).abs().max()) < TOL


@pytest.mark.parametrize("same_size", [True, False])
def test_swap_in_a_deep_model_equals_the_slow_reference(folders, same_size):
    """In the hybrid model, thoughts keeps the memory it computed under the bad image: the swapped
    view's logits equal the slow reference that rotates every stored key by its block's new offset
    (the sum of spans) and replays the Gated DeltaNet records over the new concatenation."""
    from reference import reference_logits

    engine = cothink.Engine.from_pretrained(folders("qwen35_vl"))
    bad_px = _image(24, 24, 1)
    good_px = _image(24, 24, 2) if same_size else _image(40, 16, 2)

    async def main():
        async with engine:
            ctx, bad, good, thoughts = (engine.block(n) for n in ("ctx", "bad", "good", "thoughts"))
            await engine.extend(ctx, token_ids=[5, 6, 7])
            await engine.extend(bad, image=bad_px, view=[ctx, bad])
            await engine.extend(good, image=good_px, view=[ctx, good])
            await engine.extend(thoughts, token_ids=[8, 9, 10, 11], view=[ctx, bad, thoughts])
            return ctx, bad, good, thoughts

    ctx, bad, good, thoughts = _run(main())
    runner = engine.runner
    for view in ([ctx, bad, thoughts], [ctx, good, thoughts]):
        want = reference_logits(runner, view, [20, 21])
        tail = runner.new_block()
        got = runner.step([StepItem(tail, [20, 21], [*view, tail], "all")])[0]
        runner.free(tail)
        assert float((got.double() - want).abs().max()) < TOL


# ---- memory operations ----------------------------------------------------------------------------
def test_memory_operations_on_image_blocks(folders, tiny_model, tmp_path):
    """Truncate and fork refuse to cut an image (naming the block); truncating at its edge works; a
    snapshot and a spill bring an image block back with its positions; sealing keeps its logits; the
    features are transient."""
    engine = cothink.Engine.from_pretrained(folders("qwen35_vl"), memory_budget="64MiB")
    ref = Reference(tiny_model("qwen35_vl"), engine.runner)
    vision = engine.runner.vision
    img = _image(40, 16, 3)

    async def main():
        async with engine:
            ctx, pic = engine.block("ctx"), engine.block("pic")
            await engine.extend(ctx, token_ids=[5, 6])
            await engine.extend(pic, token_ids=[7], view=[ctx, pic])
            await engine.extend(pic, image=img, view=[ctx, pic])
            await engine.extend(pic, token_ids=[8, 9], view=[ctx, pic])
            assert engine.memory().vision_bytes_used == 0  # written: the features are gone
            return ctx, pic

    ctx, pic = _run(main())
    ref.note(pic, [preprocess_image(img, vision.image)])
    span, n = pic.position_span, len(pic)
    assert span == 1 + 1 + 5 + 1 + 2  # text, vision-start, max(5, 2), vision-end, text
    for cut in (2, 5, len(pic) - 3):  # after vision-start, inside, before vision-end
        with pytest.raises(InvalidParameterError, match="pic"):
            engine.truncate(pic, cut)
    assert len(pic) == n and pic.position_span == span
    fork = engine.fork(pic)
    assert fork.vision == pic.vision and fork.position_span == span

    def logits(view):
        tail = engine.runner.new_block()
        out = engine.runner.step([StepItem(tail, [20], [*view, tail], "all")])[0]
        engine.runner.free(tail)
        return out

    want = ref.logits([ctx, pic], [20])[-1:]
    assert float((logits([ctx, pic]) - want).abs().max()) < TOL
    assert float((logits([ctx, fork]) - want).abs().max()) < TOL

    async def save():
        async with engine:
            await engine.save(tmp_path / "snap.safetensors", [pic])

    _run(save())
    (restored,) = engine.load(tmp_path / "snap.safetensors")
    assert restored.vision == pic.vision and restored.tokens == pic.tokens
    assert torch.equal(logits([ctx, restored]), logits([ctx, pic]))
    engine._residency.spill(restored)  # written to disk, then read back when named
    assert restored.spilled is not None and restored.vision == pic.vision
    engine.pin(restored)
    assert restored.spilled is None and torch.equal(logits([ctx, restored]), logits([ctx, pic]))
    engine.truncate(fork, 1 + 1 + 10 + 1)  # right after vision-end: allowed
    assert fork.position_span == 8 and len(fork.vision) == 1
    engine.truncate(fork, 1)
    assert fork.vision == [] and fork.position_span == 1
    engine.seal(pic)
    assert torch.equal(logits([ctx, pic]), logits([ctx, restored]))


# ---- bad input ------------------------------------------------------------------------------------
def test_bad_input_is_refused_and_changes_nothing(folders, tiny_model, tmp_path):
    engine = cothink.Engine.from_pretrained(folders("qwen35_vl"), max_image_tokens=12)
    text_only = cothink.Engine.from_pretrained(tiny_model("qwen35").folder)
    corrupt = tmp_path / "bad.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")

    async def main():
        async with engine, text_only:
            block = engine.block("b")
            await engine.extend(block, token_ids=[5, 6])
            before = (list(block.tokens), len(block), block.position_span, list(block.vision),
                      engine.memory().total_bytes_used)
            cases = [
                ("image", dict(image=str(corrupt))),  # undecodable bytes
                ("image", dict(image=b"GIF89a....")),
                ("image", dict(image=np.zeros((0, 5, 3), dtype=np.uint8))),  # empty
                ("image", dict(image=Image.new("RGB", (0, 0)))),
                ("image", dict(image=np.zeros((2, 500, 3), dtype=np.uint8))),  # aspect ratio 250
                ("image", dict(image=_image(64, 64, 0))),  # 16 tokens > max_image_tokens=12
                ("image", dict(image=np.zeros((8, 8), dtype=np.float32))),  # not HxWx3 uint8
                ("image", dict(image=str(tmp_path / "missing.png"))),
                ("video", dict(video=[_image(24, 24, 0), _image(24, 32, 1)])),  # sizes differ
                ("frames", dict(frames=[_image(24, 24, 0), _image(16, 24, 1)], timestamp=1.0)),
                ("frames", dict(frames=[_image(24, 24, 0)])),  # no timestamp
                ("image", dict(image=_image(24, 24, 0), token_ids=[5])),  # two inputs
            ]
            for param, kwargs in cases:
                with pytest.raises(InvalidParameterError) as info:
                    await engine.extend(block, **kwargs)
                assert info.value.param == param, (kwargs, info.value)
                after = (list(block.tokens), len(block), block.position_span, list(block.vision),
                         engine.memory().total_bytes_used)
                assert after == before, kwargs
            plain = text_only.block()
            for param, kwargs in [("image", dict(image=_image(24, 24, 0))),
                                  ("frames", dict(frames=[_image(24, 24, 0)], timestamp=0.0))]:
                with pytest.raises(InvalidParameterError, match="no vision tower") as info:
                    await text_only.extend(plain, **kwargs)
                assert info.value.param == param and len(plain) == 0
            await engine.extend(block, image=_image(24, 24, 0))  # the block still takes a good image
            assert len(block) == 2 + 2 + 9

    _run(main())


# ---- scheduling ------------------------------------------------------------------------------------
def test_encoding_is_interleaved_with_an_interactive_generation(folders):
    """While a background coroutine streams frame groups, each is encoded in a step of its own
    (never two encodes in one step), and the interactive generation gets a token in the steps
    between them."""
    engine = cothink.Engine.from_pretrained(folders("qwen35_vl"))

    async def main():
        async with engine:
            ctx, out, stream = engine.block("ctx"), engine.block("out"), engine.block("stream")
            await engine.extend(ctx, token_ids=[5, 6, 7])
            # long enough to outlast the clip; cancelled once the clip is in
            gen = engine.generate([ctx, out], max_tokens=2000, priority="interactive", name="talker",
                                  banned_token_ids=BANNED, stop_at_eos=False)
            frames = [[_image(24, 24, 2 * i), _image(24, 24, 2 * i + 1)] for i in range(4)]
            talk = asyncio.create_task(gen.collect())
            await engine.extend(stream, video=[f for pair in frames for f in pair], name="camera")
            gen.cancel()
            result = await talk
            assert result.finish_reason == "cancelled"

    _run(main())
    steps = list(engine.timeline)
    encodes = [i for i, s in enumerate(steps) if any(it.kind == "encode" for it in s.items)]
    assert len(encodes) == 4  # one frame group per step, never two
    assert all(sum(it.kind == "encode" for it in steps[i].items) == 1 for i in encodes)
    # the interactive generation is served in every step from the first encode to the last
    for i in range(encodes[0], encodes[-1] + 1):
        assert any(it.coroutine == "talker" for it in steps[i].items), i


def test_encode_steps_are_bounded_and_carry_the_interactive_token(folders):
    """Qwen3-VL's two-block tower with a budget of two blocks of a frame group per step. While an
    interactive generation decodes, a background stream's frame groups are encoded a few rows per
    step (what background text prefill may add to a step, one token here, in the decoder's multiply-adds:
    the tower is cut inside its blocks), and every step that runs tower work also carries the
    generation's token; without it, a group takes one step of two blocks. No step runs more
    patch-blocks than its budget (StepItemRecord.patch_blocks)."""
    depth, patches = 2, 36  # blocks of the tower, patches of a group of two 24 x 24 frames
    budget = depth * patches
    engine = cothink.Engine.from_pretrained(folders("qwen3_vl"), vision_step_patch_blocks=budget,
                                            interactive_step_tokens=2)
    pairs = [[_image(24, 24, 2 * i), _image(24, 24, 2 * i + 1)] for i in range(6)]
    assert engine.runner.vision.tower.depth == depth
    assert preprocess_frames(pairs[0], 0.0, engine.runner.vision.video).grid.patches == patches

    async def main():
        async with engine:
            ctx, out, stream = engine.block("ctx"), engine.block("out"), engine.block("stream")
            await engine.extend(ctx, token_ids=[5, 6, 7])
            gen = engine.generate([ctx, out], max_tokens=2000, priority="interactive", name="talker",
                                  banned_token_ids=BANNED, stop_at_eos=False)
            talk = asyncio.create_task(gen.collect())
            for t, pair in enumerate(pairs[:4]):
                await engine.extend(stream, frames=pair, timestamp=0.5 * t, name="camera")
            gen.cancel()
            assert (await talk).finish_reason == "cancelled"
            alone = engine.steps
            for t, pair in enumerate(pairs[4:], start=4):
                await engine.extend(stream, frames=pair, timestamp=0.5 * t, name="camera")
            return alone

    alone = _run(main())
    steps = list(engine.timeline)
    encode = [(s, next(it for it in s.items if it.kind == "encode")) for s in steps
              if any(it.kind == "encode" for it in s.items)]
    assert all(it.patch_blocks <= budget for _, it in encode)
    with_talker = [(s, it) for s, it in encode if s.index <= alone]
    sizes = engine._tower_sizes()
    scaled = encode_step_patch_blocks(engine.limits.scheduler, PriorityClass.BACKGROUND, True,
                                      sizes.tokens_per_patch_block)
    assert 0 < scaled < patches  # what one text token costs: a few rows of a block's phase
    assert len(with_talker) >= 4 * depth * patches / max(scaled, 1.0)
    for s, it in with_talker:
        assert it.patch_blocks <= max(1, round(scaled)) and it.coroutine == "camera", s
        assert any(i.coroutine == "talker" and i.tokens == 1 for i in s.items), s
    after = [it.patch_blocks for s, it in encode if s.index > alone]
    assert after == [budget, budget]  # one step a group: the whole budget
    assert all(it.patch_blocks == 0 for s in steps for it in s.items if it.kind != "encode")


def test_generation_right_after_an_image(folders, tiny_model):
    """A generation whose view ends with an image block recomputes the logits after its vision-end
    token (the peek reads the block one token short): greedy tokens as transformers'."""
    engine = cothink.Engine.from_pretrained(folders("qwen35_vl"))
    ref = Reference(tiny_model("qwen35_vl"), engine.runner)
    img = _image(36, 20, 4)

    async def main():
        async with engine:
            ctx, pic, out = engine.block("ctx"), engine.block("pic"), engine.block("out")
            await engine.extend(ctx, token_ids=[5, 6, 7])
            await engine.extend(pic, image=img, view=[ctx, pic])
            result = await engine.generate([ctx, pic, out], max_tokens=4, banned_token_ids=BANNED,
                                           stop_at_eos=False).collect()
            return ctx, pic, result

    ctx, pic, result = _run(main())
    ref.note(pic, [preprocess_image(img, engine.runner.vision.image)])
    assert result.token_ids == ref.greedy([ctx, pic], 4)[0]


def test_features_count_in_memory_admission(folders):
    """An encode step asks admission for its features' bytes; they are held until the extend that
    writes them leaves the scheduler."""
    from cothink.scheduler.budget import MemoryBudget
    from cothink.scheduler.policy import Priority
    from cothink.scheduler.work import EncodeWork, ExtendWork, VisionInput, VisionUnit

    engine = cothink.Engine.from_pretrained(folders("qwen35_vl"))
    store = engine.runner.store
    px = preprocess_image(_image(24, 24, 0), engine.runner.vision.image)
    row = engine._feature_row_bytes()
    assert row == 64 * 4  # hidden x float32, no DeepStack
    sizes = engine._tower_sizes()
    # hidden, q/k/v, rotary cos and sin
    assert sizes.depth == 1 and sizes.patch_state_bytes == (4 * 32 + 2 * 16) * 4
    state = px.grid.patches * sizes.patch_state_bytes

    async def main():
        block = engine.block()
        unit = VisionUnit(px.pixel_values, px.grid, 1, px.merged_rows, px.merged_cols)
        extend = ExtendWork("c", Priority(), [block], 1, [VS, *[IMAGE] * px.tokens, VE], VisionInput([unit]))
        encode = EncodeWork("c", Priority(), 2, extend, sizes)
        budget = MemoryBudget(store)
        (growth,) = encode.growth(1)
        # the image's tower state and its features, admitted when it starts
        assert budget.bytes_needed(growth) == state + px.tokens * row and budget.pages(growth) == 0
        encode.plan_compute(px.grid.patches)  # the whole (one-block) tower
        assert encode.items(1, engine.runner) == [] and store.vision_bytes == state + px.tokens * row
        encode.compute(engine.runner)
        encode.after_step([], engine.runner)
        assert encode.finished and encode.successor() is extend
        assert store.vision_bytes == px.tokens * row == engine.memory().vision_bytes_used
        assert engine.memory().total_bytes_used == store.total_bytes()
        encode.release_memory(store)  # done well: the extend keeps them
        assert store.vision_bytes == px.tokens * row
        extend.release_memory(store)
        assert store.vision_bytes == 0 and engine.memory().vision_bytes_used == 0

    _run(main())


def test_an_image_encoded_over_many_steps(folders):
    """Qwen3-VL's two-block tower, one block per step (a budget of the image's patches): the image's
    state (and room for its features) is held between its steps and admitted once; its features,
    DeepStack included, equal one forward pass bit for bit; an encode cut off mid-image releases its
    state."""
    from cothink.scheduler.policy import Priority
    from cothink.scheduler.work import EncodeWork, ExtendWork, VisionInput, VisionUnit

    engine = cothink.Engine.from_pretrained(folders("qwen3_vl"))
    runner, store = engine.runner, engine.runner.store
    sizes = engine._tower_sizes()
    assert sizes.depth == 2 and sizes.feature_row_bytes == 64 * 4 * 3  # merged + two DeepStack layers
    images = [preprocess_image(_image(40, 16, 5), runner.vision.image),
              preprocess_image(_image(24, 24, 6), runner.vision.image)]

    def encode_work(seq: int) -> EncodeWork:
        units, tokens = [], []
        for px in images:
            first = len(tokens) + 1
            units.append(VisionUnit(px.pixel_values, px.grid, first, px.merged_rows, px.merged_cols))
            tokens += [VS, *[IMAGE] * px.tokens, VE]
        extend = ExtendWork("c", Priority(), [engine.block()], seq, tokens, VisionInput(units))
        return EncodeWork("c", Priority(), seq + 1, extend, sizes)

    async def main():
        encode = encode_work(1)
        ran = []
        for px in images:
            held = store.vision_bytes
            peak = px.grid.patches * sizes.patch_state_bytes + px.tokens * sizes.feature_row_bytes
            for block in range(sizes.depth):
                (growth,) = encode.growth(1)
                assert growth.extra_bytes == (peak if block == 0 else 0)  # admitted once, at the start
                encode.plan_compute(px.grid.patches)  # one block
                encode.items(1, runner)
                encode.compute(runner)
                encode.after_step([], runner)
                ran.append(encode.step_patch_blocks())
                if block < sizes.depth - 1:
                    assert store.vision_bytes == held + peak and not encode.finished
            assert store.vision_bytes == held + px.tokens * sizes.feature_row_bytes  # only the features stay
        assert ran == [px.grid.patches for px in images for _ in range(sizes.depth)]
        assert encode.finished and encode.served == sum(px.tokens for px in images)
        for px, got in zip(images, encode.vision.features, strict=True):
            want = runner.vision.encode(px.pixel_values, px.grid)
            assert torch.equal(got.merged, want.merged)
            assert len(got.deepstack) == 2
            for a, b in zip(got.deepstack, want.deepstack, strict=True):
                assert torch.equal(a, b)
        encode.release_memory(store)
        encode.extend.release_memory(store)
        assert store.vision_bytes == 0
        # cut off after the first block of its first image: state and features go
        cut = encode_work(3)
        cut.plan_compute(1)
        cut.items(1, runner)
        cut.compute(runner)
        cut.after_step([], runner)
        assert store.vision_bytes > 0 and not cut.finished
        cut.cancel()
        cut.release_memory(store)
        assert store.vision_bytes == 0 == engine.memory().vision_bytes_used
        assert cut.extend.future.cancelled()

    _run(main())


def test_an_image_being_written_is_read_only_once_whole(folders):
    """Other items read a block up to the vision-start of an image still being written (a partial
    image is no sequence the model was trained on); the writer's own chunks continue it exactly."""
    from cothink.execution.step import VisionChunk
    from cothink.memory.block import VisionSpan

    engine = cothink.Engine.from_pretrained(folders("qwen35_vl"))
    runner = engine.runner
    px = preprocess_image(_image(40, 16, 5), runner.vision.image)
    feats = runner.vision.encode(px.pixel_values, px.grid).merged
    ctx, pic = runner.new_block("ctx"), runner.new_block("pic")
    runner.extend(ctx, [5, 6])
    runner.extend(pic, [7], [ctx, pic])
    run = VisionSpan(2, px.merged_rows, px.merged_cols)
    runner.step([StepItem(pic, [VS, IMAGE, IMAGE, IMAGE], [ctx, pic], "none",
                          vision=VisionChunk((run,), torch.arange(1, 4), feats[:3]))])
    assert px.merged_cols == 2  # three placeholders: row 0 and the first of row 1, counter 2 at the grid
    assert len(pic) == 5 and pic.readable_length == 1 and pic.position_span == 2 + 1 + 1
    assert runner.cached_logits([ctx, pic]) is None
    with pytest.raises(InvalidParameterError, match="pic"):
        runner.fork(pic)

    def read(view, lengths=None):
        tail = runner.new_block()
        out = runner.step([StepItem(tail, [20], [*view, tail], "last", lengths)])[0]
        runner.free(tail)
        return out

    assert torch.equal(read([ctx, pic]), read([ctx, pic], [2, 1]))
    rest = px.tokens - 3
    runner.step([StepItem(pic, [IMAGE] * rest + [VE], [ctx, pic], "last",
                          vision=VisionChunk((), torch.arange(rest), feats[3:]))])
    assert pic.readable_length == len(pic) == 2 + px.tokens + 1
    assert not torch.equal(read([ctx, pic]), read([ctx, pic], [2, 1]))


def test_cancelling_an_image_extend_while_it_encodes(folders):
    """A caller cancelled while its clip is being encoded: the block stays empty, it takes a new
    writer at once, and the features encoded so far are released."""
    engine = cothink.Engine.from_pretrained(folders("qwen35_vl"))
    clip = [_image(24, 24, i) for i in range(24)]  # twelve frame groups, one encoded per step

    async def main():
        async with engine:
            block = engine.block("clip")
            task = asyncio.create_task(engine.extend(block, video=clip, name="camera"))
            while not any(it.kind == "encode" for s in engine.timeline for it in s.items):
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert len(block) == 0 and block.vision == []
            await engine.extend(block, token_ids=[5, 6])  # no BlockBusyError
            assert block.tokens == [5, 6]
            # released when the encode left the scheduler (after the step it was part of)
            assert engine.memory().vision_bytes_used == 0
            encodes = sum(it.kind == "encode" for s in engine.timeline for it in s.items)
            return encodes

    assert 1 <= _run(main()) < 12


def test_an_engine_stopped_while_pixels_are_prepared_refuses_the_extend(folders):
    """The engine stops while an image extend's pixels are prepared off the event loop: the extend
    raises EngineClosedError instead of submitting work no step will ever run (it used to hang)."""
    engine = cothink.Engine.from_pretrained(folders("qwen35_vl"))

    async def main():
        await engine.start()
        block = engine.block("picture")
        task = asyncio.create_task(engine.extend(block, image=_image(24, 24, 1), name="camera"))
        await asyncio.sleep(0)  # the extend is now waiting for its preprocessing thread
        await engine.stop()
        with pytest.raises(EngineClosedError):
            await asyncio.wait_for(task, 30)
        assert len(block) == 0 and engine.occupancy().works == 0

    _run(main())
