"""The span rule (cothink.models.mrope) against transformers' get_rope_index and rotary embeddings.

Blocks of text, images of different shapes and video frame groups get local positions from their own
counter at 0; placed in a view at the sum of the spans before them, they equal the positions
transformers computes on the blocks' tokens concatenated in view order (Qwen3.5 and Qwen3-VL).
"""

from __future__ import annotations

import random

import pytest
import torch

from cothink.models.mrope import (
    TextRun,
    VisionRun,
    local_positions,
    mrope_axes,
    mrope_cos_sin,
    run_positions,
    span_at,
    view_offsets,
)

IMAGE, VIDEO, VS, VE = 296, 297, 298, 299
MERGE = 2
VIS = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
           temporal_patch_size=2, spatial_merge_size=MERGE, num_position_embeddings=16)
IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VS, vision_end_token_id=VE)


@pytest.fixture(scope="module")
def rope_models():
    """get_rope_index of a tiny Qwen3.5 and a tiny Qwen3-VL model."""
    import transformers as tf

    text = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    q35 = tf.Qwen3_5Model(tf.Qwen3_5Config(
        text_config={**text, "layer_types": ["full_attention"]}, vision_config=VIS, **IDS))
    q3vl = tf.Qwen3VLModel(tf.Qwen3VLConfig(
        text_config=text, vision_config={**VIS, "deepstack_visual_indexes": [0]}, **IDS))
    return {"qwen3_5": q35.eval(), "qwen3_vl": q3vl.eval()}


# A block is a list of pieces; each piece is (token ids, mm type per token, run, grid or None).
def _text(rng: random.Random, n: int) -> tuple[list[int], list[int], TextRun, None]:
    return [rng.randrange(0, 256) for _ in range(n)], [0] * n, TextRun(n), None


def _vision(rows: int, cols: int, kind: int) -> tuple[list[int], list[int], VisionRun, tuple[int, int, int]]:
    n, grid = rows * cols, (1, rows * MERGE, cols * MERGE)
    return [IMAGE if kind == 1 else VIDEO] * n, [kind] * n, VisionRun(rows, cols), grid


def _image_piece(rng: random.Random, rows: int, cols: int, close: bool = True) -> list:
    pieces = [([VS], [0], TextRun(1), None), _vision(rows, cols, 1)]
    if close:
        pieces.append(([VE], [0], TextRun(1), None))
    return pieces


def _video_piece(rng: random.Random, groups: int, rows: int, cols: int) -> list:
    out = []
    for _ in range(groups):  # each group: timestamp text, vision start, the group, vision end
        out += [_text(rng, rng.randint(2, 7)), ([VS], [0], TextRun(1), None), _vision(rows, cols, 2),
                ([VE], [0], TextRun(1), None)]
    return out


def _random_blocks(rng: random.Random) -> list[list]:
    """Blocks as in a multimodal session: text, images of several shapes (tall, wide, square, 1x1), video
    clips of 1-3 groups, a block that ends on its image (no vision end), an empty block. Every vision run
    follows a vision-start token of its own block, so no two runs meet across blocks."""
    blocks = [
        [_text(rng, 5)],
        [_text(rng, 2), *_image_piece(rng, 2, 3), _text(rng, 1)],
        [*_image_piece(rng, 4, 1)],  # tall
        [_text(rng, 3), *_image_piece(rng, 1, 5), *_image_piece(rng, 3, 3)],  # wide then square, adjacent
        [*_video_piece(rng, 2, 2, 4), _text(rng, 2)],
        [_text(rng, 4), *_image_piece(rng, 2, 2, close=False)],  # ends on vision tokens
        [],
        [*_image_piece(rng, 1, 1), *_video_piece(rng, 3, 3, 2)],
        [_text(rng, 1)],
    ]
    return blocks


def _reference(model, pieces: list) -> tuple[torch.Tensor, int]:
    ids = [t for p in pieces for t in p[0]]
    types = [t for p in pieces for t in p[1]]
    images = [p[3] for p in pieces if p[3] is not None and p[1][0] == 1]
    # groups of one size in a row are one video_grid_thw row with t = groups (transformers splits it)
    videos: list[list[int]] = []
    for p in pieces:
        if p[3] is not None and p[1][0] == 2:
            if videos and videos[-1][1:] == list(p[3][1:]):
                videos[-1][0] += 1
            else:
                videos.append(list(p[3]))
    pos, delta = model.get_rope_index(
        torch.tensor([ids]), mm_token_type_ids=torch.tensor([types]),
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor(videos) if videos else None)
    return pos[:, 0], int(delta)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_views_in_random_orders_equal_get_rope_index(rope_models, family, seed):
    rng = random.Random(seed)
    blocks = _random_blocks(rng)
    local = [local_positions([p[2] for p in block]) for block in blocks]
    for _ in range(4):
        order = rng.sample(range(len(blocks)), k=rng.randint(2, len(blocks)))
        spans = [local[j][1] for j in order]
        offsets = view_offsets(spans)
        got = torch.cat([local[j][0] + off for j, off in zip(order, offsets)], dim=1)
        want, delta = _reference(rope_models[family], [p for j in order for p in blocks[j]])
        assert torch.equal(got, want), (order, got, want)
        # the writer's next position: the sum of the spans, = sequence length + rope_deltas
        assert sum(spans) == want.shape[1] + delta == int(want.max()) + 1


def test_span_rule_details():
    pos, span = local_positions([TextRun(3), TextRun(1), VisionRun(2, 3), TextRun(1)])
    assert span == 3 + 1 + 3 + 1 and span_at(pos) == span
    assert pos[:, 4:10].tolist() == [[4] * 6, [4, 4, 4, 5, 5, 5], [4, 5, 6, 4, 5, 6]]
    assert pos[:, 10].tolist() == [7, 7, 7]  # text resumes at max + 1 on all three axes
    # a tall image (4 x 1) advances by 4, a wide one (1 x 5) by 5, a 16 x 16 grid of 256 tokens by 16
    assert local_positions([VisionRun(4, 1)])[1] == 4
    assert local_positions([VisionRun(1, 5)])[1] == 5
    assert local_positions([VisionRun(16, 16)])[1] == 16
    # appending continues from the span: two extends equal one
    first, c = run_positions(0, [TextRun(2), VisionRun(3, 2)])
    second, c2 = run_positions(c, [TextRun(1), VisionRun(1, 4)])
    whole, s = local_positions([TextRun(2), VisionRun(3, 2), TextRun(1), VisionRun(1, 4)])
    assert torch.equal(torch.cat([first, second], 1), whole) and c2 == s
    # prefix spans (read lengths): text-only blocks span their length; inside a run, the prefix maximum
    text, _ = local_positions([TextRun(7)])
    assert [span_at(text, n) for n in range(8)] == list(range(8))
    assert span_at(pos, 0) == 0 and span_at(pos, 5) == 5 and span_at(pos, 8) == 7
    assert view_offsets([5, 0, 7, 3]) == [0, 5, 5, 12]
    assert local_positions([])[0].shape == (3, 0)


@pytest.mark.parametrize(
    ("head_dim", "partial", "section", "family"),
    [(256, 0.25, [11, 11, 10], "qwen3_5"), (32, 0.5, [4, 2, 2], "qwen3_5"), (32, 0.25, [2, 1, 1], "qwen3_5"),
     (128, 1.0, [24, 20, 20], "qwen3_vl"), (16, 1.0, [4, 2, 2], "qwen3_vl")])
def test_cos_sin_equal_transformers(head_dim, partial, section, family):
    import transformers as tf

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section,
            "mrope_interleaved": True}
    shape = dict(head_dim=head_dim, num_attention_heads=2, hidden_size=64)
    if family == "qwen3_5":
        rope["partial_rotary_factor"] = partial
        cfg = tf.Qwen3_5TextConfig(**shape, rope_parameters=rope)
        emb = tf.models.qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(cfg)
    else:
        cfg = tf.Qwen3VLTextConfig(**shape, rope_parameters=rope)
        emb = tf.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding(cfg)
    gen = torch.Generator().manual_seed(0)
    pos3 = torch.randint(0, 3000, (3, 50), generator=gen)
    want_cos, want_sin = emb(torch.zeros(1, dtype=torch.float32), pos3[:, None, :])
    cos, sin = mrope_cos_sin(pos3, emb.inv_freq, section, emb.attention_scaling)
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    # equal axes (text tokens): the 1-D rotary at that position
    p = torch.arange(0, 500, 7)
    cos1, sin1 = mrope_cos_sin(p.expand(3, -1), emb.inv_freq, section)
    f = p[:, None].float() * emb.inv_freq
    assert torch.equal(cos1, torch.cat([f, f], -1).cos()) and torch.equal(sin1, torch.cat([f, f], -1).sin())


def test_frequency_axes():
    axes = "".join("THW"[a] for a in mrope_axes(32, [11, 11, 10]).tolist())
    assert axes == "THW" * 10 + "TH"
    assert "".join("THW"[a] for a in mrope_axes(64, [24, 20, 20]).tolist()) == "THW" * 20 + "TTTT"
    assert "".join("THW"[a] for a in mrope_axes(4, [11, 11, 10]).tolist()) == "THWT"
