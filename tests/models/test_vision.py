"""The vision tower (cothink.models.vision) against transformers' own towers, fp32, every parameter random.

Qwen3.5 (`Qwen3_5VisionModel`) and Qwen3-VL (`Qwen3VLVisionModel`, with its DeepStack features) on a batch
of images of different shapes and videos of several frame groups; each grid's features do not depend on
the others in the batch; the tower loads from a checkpoint saved by transformers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from cothink.errors import InvalidParameterError, UnsupportedModelError
from cothink.models.config import load_config, load_vision_config, vision_config_from_hf
from cothink.models.image_processing import ImageProcessorConfig, preprocess_image
from cothink.models.vision import PatchGrid, VisionTower
from cothink.models.weights import load_vision_tower

TOL = 1e-5
VIS = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, patch_size=4,
           temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
IDS = dict(image_token_id=296, video_token_id=297, vision_start_token_id=298, vision_end_token_id=299,
           tie_word_embeddings=False)
TEXT = dict(vocab_size=300, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=24)
# images of different shapes (tall, wide, square, one merge block), a 3-group video, a 2-group video
GRIDS = [PatchGrid(1, 6, 8), PatchGrid(1, 8, 2), PatchGrid(3, 4, 6), PatchGrid(1, 2, 10), PatchGrid(1, 2, 2),
         PatchGrid(2, 10, 4)]


@torch.no_grad()
def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random: matrices ~ N(0, 1/fan_in), biases and norm shifts small, norm scales near 1."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name and name.endswith("weight"):
            p.copy_(1 + 0.2 * noise)
        elif p.dim() == 1:
            p.copy_(0.2 * noise)
        else:
            p.copy_(noise / p[0].numel() ** 0.5)


def _build(family: str, seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    if family == "qwen3_5":
        model = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(
            text_config={**TEXT, "layer_types": ["full_attention"]}, vision_config=VIS, **IDS))
    else:
        model = tf.Qwen3VLForConditionalGeneration(tf.Qwen3VLConfig(
            text_config=TEXT, vision_config={**VIS, "depth": 3, "deepstack_visual_indexes": [0, 2]}, **IDS))
    model.eval()
    _randomize(model.model.visual, seed + 1)
    return model


def _tower_from(visual: torch.nn.Module, cfg) -> VisionTower:
    tower = VisionTower(cfg)
    state = dict(visual.state_dict())
    state["patch_embed.proj.weight"] = state["patch_embed.proj.weight"].flatten(1)
    tower.load_state_dict(state)
    return tower.eval()


def _pixels(grids: list[PatchGrid], patch_dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(sum(g.patches for g in grids), patch_dim, generator=gen)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl"])
@torch.no_grad()
def test_tower_equals_transformers(family):
    model = _build(family)
    cfg = vision_config_from_hf(model.config)
    assert cfg is not None and cfg.family == family
    tower = _tower_from(model.model.visual, cfg)
    x = _pixels(GRIDS, cfg.patch_dim, seed=3)
    ref = model.model.visual(x, grid_thw=torch.tensor([[g.t, g.h, g.w] for g in GRIDS]))
    got = tower(x, GRIDS)
    assert got.merged.shape == (sum(g.tokens(2) for g in GRIDS), 48)
    scale = float(ref.pooler_output.abs().max())
    assert 0.3 < scale < 30  # outputs of order one: the tolerance means something
    assert float((got.merged - ref.pooler_output).abs().max()) < TOL * scale
    if family == "qwen3_vl":
        assert len(got.deepstack) == len(ref.deepstack_features) == 2
        for mine, theirs in zip(got.deepstack, ref.deepstack_features):
            assert float((mine - theirs).abs().max()) < TOL * float(theirs.abs().max())
    else:
        assert got.deepstack == ()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl"])
@torch.no_grad()
def test_features_are_context_free(family):
    """A grid's features alone equal its rows in a batch; a video's frame groups encoded one at a time
    equal the video encoded whole (streams can encode group by group). Up to rounding: matrix kernels
    may round a row differently in a batch of another size (seen up to 1.7e-6 on features of scale 2)."""
    model = _build(family, seed=5)
    cfg = vision_config_from_hf(model.config)
    tower = _tower_from(model.model.visual, cfg)
    x = _pixels(GRIDS, cfg.patch_dim, seed=4)
    batch = tower(x, GRIDS)
    parts = batch.split(GRIDS, cfg.spatial_merge_size)
    start = 0
    for grid, part in zip(GRIDS, parts):
        pixels = x[start : start + grid.patches]
        start += grid.patches
        alone = tower(pixels, [grid])
        assert torch.allclose(alone.merged, part.merged, atol=1e-5, rtol=0)
        for a, b in zip(alone.deepstack, part.deepstack, strict=True):
            assert torch.allclose(a, b, atol=1e-5, rtol=0)
        if grid.t > 1:  # group by group
            step = PatchGrid(1, grid.h, grid.w)
            groups = [tower(frame, [step]) for frame in pixels.split(step.patches)]
            assert torch.allclose(torch.cat([g.merged for g in groups]), part.merged, atol=1e-5, rtol=0)


@torch.no_grad()
def test_bfloat16_tower_close_to_fp32():
    model = _build("qwen3_5", seed=7)
    cfg = vision_config_from_hf(model.config)
    tower = _tower_from(model.model.visual, cfg)
    x = _pixels(GRIDS, cfg.patch_dim, seed=8)
    want = tower(x, GRIDS).merged
    got = tower.to(torch.bfloat16)(x, GRIDS).merged
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want).abs().max()) < 0.05 * float(want.abs().max())


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl"])
@torch.no_grad()
def test_stages_equal_the_forward_bit_for_bit(family):
    """start, run_blocks in pieces of any size, finish: the forward's features exactly (the merged
    tokens and, for Qwen3-VL, the DeepStack features of its blocks 0 and 2), for a batch of images and
    video grids, one image and one frame group; the state holds its rows between stages."""
    model = _build(family, seed=11)
    cfg = vision_config_from_hf(model.config)
    tower = _tower_from(model.model.visual, cfg)
    x = _pixels(GRIDS, cfg.patch_dim, seed=12)
    group = PatchGrid(1, 10, 4)  # one frame group of a stream
    cases = [(x, GRIDS), (x[: GRIDS[0].patches], GRIDS[:1]), (x[: group.patches], [group])]
    for pixels, grids in cases:
        want = tower(pixels, grids)
        for pieces in ([1] * tower.depth, [2, 1], [tower.depth], [tower.depth + 5]):
            state = tower.start(pixels, grids)
            assert state.done == 0 and state.nbytes() == state.patches * tower.state_row_bytes()
            for n in pieces:
                tower.run_blocks(state, n)
            assert state.done == tower.depth
            got = tower.finish(state)
            assert torch.equal(got.merged, want.merged), (family, grids, pieces)
            assert len(got.deepstack) == len(cfg.deepstack_layers)
            for a, b in zip(got.deepstack, want.deepstack, strict=True):
                assert torch.equal(a, b)
    state = tower.start(x, GRIDS)
    tower.run_blocks(state, 1)
    with pytest.raises(InvalidParameterError, match="1 of"):
        tower.finish(state)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl"])
@torch.no_grad()
def test_work_cut_inside_blocks_equals_the_forward(family):
    """`run` stops after any row of either phase of a block (frames cut mid-way, grids of several
    frame sizes): the features equal the forward's up to the rounding of smaller matrix products; each
    call runs at least one row and no more work than asked beyond that row; `run_blocks` after a cut
    finishes the block begun."""
    model = _build(family, seed=11)
    cfg = vision_config_from_hf(model.config)
    tower = _tower_from(model.model.visual, cfg)
    x = _pixels(GRIDS, cfg.patch_dim, seed=12)
    want = tower(x, GRIDS)
    scale = float(want.merged.abs().max())
    first, second = tower.phase_shares()
    assert 0 < first < 1 and abs(first + second - 1) < 1e-12
    patches = x.shape[0]
    for budget in (0.01, 5.5, 37.0, patches * 0.7):
        state, calls = tower.start(x, GRIDS), 0
        while state.done < tower.depth:
            before = (state.done, state.phase, state.row)
            ran = tower.run(state, budget)
            calls += 1
            assert (state.done, state.phase, state.row) != before
            assert ran <= budget + 1e-9 or ran <= max(first, second) + 1e-9  # one forced row at most
        assert state.qkv is None and state.row == 0 and state.phase == 0
        got = tower.finish(state)
        assert float((got.merged - want.merged).abs().max()) <= 1e-5 * scale, (family, budget)
        for a, b in zip(got.deepstack, want.deepstack, strict=True):
            assert float((a - b).abs().max()) <= 1e-5 * max(1.0, float(b.abs().max()))
        assert calls >= tower.depth * patches / max(budget, patches) - 1
    state = tower.start(x, GRIDS)
    tower.run(state, 3.0)  # inside block 0
    assert state.done == 0 and state.row > 0
    tower.run_blocks(state, 1)
    assert state.done == 1 and state.row == 0 and state.phase == 0


def test_bad_grids_are_refused():
    model = _build("qwen3_5", seed=9)
    cfg = vision_config_from_hf(model.config)
    tower = _tower_from(model.model.visual, cfg)
    with pytest.raises(InvalidParameterError, match="merge size"):
        tower(torch.zeros(15, cfg.patch_dim), [PatchGrid(1, 3, 5)])
    with pytest.raises(InvalidParameterError, match="do not match"):
        tower(torch.zeros(10, cfg.patch_dim), [PatchGrid(1, 2, 4)])


# ---- loading -------------------------------------------------------------------------------------------
@torch.no_grad()
def test_multimodal_checkpoint_loads_its_tower(tiny_model):
    """The tiny Qwen3.5 multimodal checkpoint (saved by transformers): the config carries the tower, its
    weights load, and image features equal transformers' model.visual on the same pixel values."""
    tm = tiny_model("qwen35_mm")
    cfg = load_config(tm.folder)
    assert cfg.vision == load_vision_config(tm.folder)
    vision = cfg.vision
    assert (vision.family, vision.patch_size, vision.out_hidden_size, vision.image_token_id) == (
        "qwen3_5", 4, cfg.hidden_size, 296)
    tower = load_vision_tower(vision, tm.folder, torch.float32, "cpu")
    assert not any(p.is_meta for p in tower.parameters())
    proc = ImageProcessorConfig(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8,
                                max_pixels=64 * 64, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)
    rng = np.random.default_rng(0)
    images = [preprocess_image(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)), proc)
              for h, w in [(40, 24), (17, 70), (64, 64)]]
    x = torch.cat([im.pixel_values for im in images])
    grids = [im.grid for im in images]
    want = tm.ref.model.visual(x, grid_thw=torch.tensor([[g.t, g.h, g.w] for g in grids])).pooler_output
    got = tower(x, grids).merged
    assert float((got - want).abs().max()) < TOL * max(1.0, float(want.abs().max()))
    # bfloat16 load: same names, same features within bf16 rounding
    half = load_vision_tower(vision, tm.folder, torch.bfloat16, "cpu")
    assert half.dtype == torch.bfloat16
    assert float((half(x, grids).merged.float() - want).abs().max()) < 0.05 * float(want.abs().max())


@torch.no_grad()
def test_qwen3_vl_checkpoint_loads_its_tower(tmp_path):
    model = _build("qwen3_vl", seed=11)
    model.save_pretrained(tmp_path)
    vision = load_vision_config(tmp_path)
    assert vision.family == "qwen3_vl" and vision.deepstack_layers == (0, 2)
    tower = load_vision_tower(vision, tmp_path, torch.float32, "cpu")
    x = _pixels(GRIDS, vision.patch_dim, seed=12)
    ref = model.model.visual(x, grid_thw=torch.tensor([[g.t, g.h, g.w] for g in GRIDS]))
    got = tower(x, GRIDS)
    assert float((got.merged - ref.pooler_output).abs().max()) < TOL * float(ref.pooler_output.abs().max())
    for mine, theirs in zip(got.deepstack, ref.deepstack_features, strict=True):
        assert float((mine - theirs).abs().max()) < TOL * float(theirs.abs().max())


def test_text_only_checkpoints_have_no_tower(tiny_model, tmp_path):
    tm = tiny_model("qwen35")
    assert load_config(tm.folder).vision is None
    with pytest.raises(UnsupportedModelError, match="no vision tower"):
        load_vision_config(tm.folder)
    # a multimodal config whose weights lack the tower
    from safetensors.torch import load_file, save_file

    mm = tiny_model("qwen35_mm")
    for name in ("config.json",):
        (tmp_path / name).write_text((mm.folder / name).read_text())
    state = {k: v for k, v in load_file(str(mm.folder / "model.safetensors")).items() if "visual" not in k}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="missing"):
        load_vision_tower(load_vision_config(tmp_path), tmp_path, torch.float32, "cpu")


@torch.no_grad()
def test_pieces_compose_to_the_multimodal_forward(tiny_model):
    """Preprocessing, placeholders, the tower (each image and frame group encoded alone) and the span
    rule's positions, fed to transformers' text decoder, give the logits of transformers' multimodal
    forward on the same sequence (pixels in, positions from get_rope_index)."""
    from cothink.models.image_processing import VideoProcessorConfig, placeholder_ids, preprocess_video
    from cothink.models.mrope import TextRun, local_positions

    tm = tiny_model("qwen35_mm")
    vision = load_config(tm.folder).vision
    tower = load_vision_tower(vision, tm.folder, torch.float32, "cpu")
    proc = ImageProcessorConfig(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8,
                                max_pixels=48 * 48, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)
    vproc = VideoProcessorConfig(patch_size=4, min_pixels=8 * 8, max_pixels=4 * 24 * 24)
    rng = np.random.default_rng(1)
    tall = preprocess_image(rng.integers(0, 256, (40, 16, 3), dtype=np.uint8), proc)
    wide = preprocess_image(rng.integers(0, 256, (12, 44, 3), dtype=np.uint8), proc)
    groups = preprocess_video([rng.integers(0, 256, (30, 20, 3), dtype=np.uint8) for _ in range(4)], vproc)
    assert len(groups) == 2

    ids, types, runs, feats = [], [], [], []

    def text(tokens: list[int]) -> None:
        ids.extend(tokens)
        types.extend([0] * len(tokens))
        runs.append(TextRun(len(tokens)))

    def visual(pixels, kind: int) -> None:
        pad = placeholder_ids(vision, pixels.tokens, video=kind == 2)
        text(pad[:1])
        ids.extend(pad[1:-1])
        types.extend([kind] * pixels.tokens)
        runs.append(pixels.vision_run)
        feats.append(tower(pixels.pixel_values, [pixels.grid]).merged)
        text(pad[-1:])

    text([5, 6, 7])
    visual(tall, 1)
    text([8, 9])
    visual(wide, 1)
    for g in groups:
        text(list(g.text.encode()))  # the timestamp as byte tokens of the tiny tokenizer
        visual(g, 2)
    text([10])

    pixel_values = torch.cat([tall.pixel_values, wide.pixel_values])
    want = tm.ref(
        input_ids=torch.tensor([ids]), mm_token_type_ids=torch.tensor([types]),
        pixel_values=pixel_values, image_grid_thw=torch.tensor([[1, tall.grid.h, tall.grid.w],
                                                                [1, wide.grid.h, wide.grid.w]]),
        pixel_values_videos=torch.cat([g.pixel_values for g in groups]),
        video_grid_thw=torch.tensor([[2, groups[0].grid.h, groups[0].grid.w]]), use_cache=False).logits[0]

    lm = tm.ref.model.language_model
    embeds = lm.embed_tokens(torch.tensor(ids))
    vision_rows = torch.tensor(types) != 0
    embeds[vision_rows] = torch.cat(feats)
    pos3, span = local_positions(runs)
    hidden = lm(inputs_embeds=embeds[None], position_ids=pos3[:, None, :], use_cache=False).last_hidden_state
    got = tm.ref.lm_head(hidden)[0]
    assert span < len(ids)
    assert float((got - want).abs().max()) < 1e-4
