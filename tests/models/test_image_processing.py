"""Pixels to patches (cothink.models.image_processing) against transformers.

Images: equal (bit for bit) to `Qwen2VLImageProcessorPil` built from the same preprocessor_config.json, for
every accepted input kind and for upscaled, downscaled, odd-aspect and exact-multiple sizes. Videos: the
sampling, the shared pixel budget, the patch layout and the timestamps against the Qwen3-VL video
processor's and processor's own functions (the processor classes themselves need torchvision). Bad input:
typed errors naming the parameter.
"""

from __future__ import annotations

import base64
import io
import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from cothink.errors import InvalidParameterError
from cothink.models.config import VisionConfig
from cothink.models.image_processing import (
    ImageProcessorConfig,
    VideoProcessorConfig,
    group_timestamps,
    load_processor_configs,
    load_rgb,
    placeholder_ids,
    preprocess_frames,
    preprocess_image,
    preprocess_video,
    sample_frame_indices,
    smart_resize,
    smart_resize_video,
    timestamp_text,
    video_max_pixels,
)

# the released Qwen3-VL / Qwen3.5 values, with a smaller pixel range so the test images stay small
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorPil", "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 3,
    "rescale_factor": 0.00392156862745098, "do_rescale": True, "do_normalize": True, "do_resize": True,
    "do_convert_rgb": True, "size": {"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32},
}
SIZES = [(60, 100), (333, 517), (1000, 40), (64, 64), (5, 7), (48, 80), (2000, 1500), (96, 1), (1, 150)]


def _reference(folder: Path):
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
    assert type(proc).__name__ == "Qwen2VLImageProcessorPil"
    return proc


def _folder(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    return tmp_path


def _image(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _assert_same(ref, image, cfg: ImageProcessorConfig, **ref_kw) -> None:
    want = ref(image, return_tensors="pt", **ref_kw)
    got = preprocess_image(image, cfg)
    assert [got.grid.t, got.grid.h, got.grid.w] == want["image_grid_thw"][0].tolist()
    assert got.pixel_values.dtype == torch.float32
    assert torch.equal(got.pixel_values, want["pixel_values"])
    assert got.tokens == int(want["image_grid_thw"][0].prod()) // 4 == got.vision_run.tokens


@pytest.mark.parametrize(("h", "w"), SIZES)
def test_images_equal_qwen2vl_pil_processor(tmp_path, h, w):
    folder = _folder(tmp_path, PREPROCESSOR)
    ref = _reference(folder)
    cfg, _ = load_processor_configs(folder)
    assert (cfg.patch_size, cfg.min_pixels, cfg.max_pixels, cfg.image_mean) == (16, 4096, 65536, (0.5,) * 3)
    array = _image(h, w, seed=h * w)
    _assert_same(ref, Image.fromarray(array), cfg)
    _assert_same(ref, array, cfg, input_data_format="channels_last")


def test_every_input_kind_gives_the_same_pixels(tmp_path):
    """PIL (RGB, RGBA with transparency, greyscale, palette), an HxWx3 array, a file path (str and Path),
    encoded bytes and a data URL."""
    folder = _folder(tmp_path, PREPROCESSOR)
    ref = _reference(folder)
    cfg, _ = load_processor_configs(folder)
    array = _image(70, 90, seed=1)
    rgba = np.concatenate([array, np.random.default_rng(2).integers(0, 256, (70, 90, 1), dtype=np.uint8)], -1)
    for image in [Image.fromarray(rgba, "RGBA"), Image.fromarray(array).convert("L"),
                  Image.fromarray(array).convert("P", palette=Image.Palette.ADAPTIVE)]:
        _assert_same(ref, image, cfg)
    png = io.BytesIO()
    Image.fromarray(array).save(png, format="PNG")
    path = tmp_path / "image.png"
    path.write_bytes(png.getvalue())
    want = preprocess_image(Image.fromarray(array), cfg).pixel_values
    data_url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    for source in [array, str(path), path, png.getvalue(), data_url]:
        assert torch.equal(preprocess_image(source, cfg).pixel_values, want)


def test_processor_config_reading(tmp_path):
    """Legacy min_pixels/max_pixels win over size; missing keys take the class defaults; a folder without
    the file gets the released values with the tower's patch geometry."""
    folder = _folder(tmp_path, {"image_processor_type": "Qwen2VLImageProcessorPil", "min_pixels": 3136,
                                "max_pixels": 200000, "size": {"shortest_edge": 1, "longest_edge": 2}})
    ref = _reference(folder)
    cfg, _ = load_processor_configs(folder)
    assert (cfg.patch_size, cfg.min_pixels, cfg.max_pixels) == (14, 3136, 200000)
    for h, w in [(300, 500), (20, 30)]:
        _assert_same(ref, Image.fromarray(_image(h, w, seed=h)), cfg)

    empty = tmp_path / "none"
    empty.mkdir()
    vision = VisionConfig("qwen3_5", 1, 8, 16, 2, 3, 4, 2, 2, 16, 16, "gelu", 1e4, (), 296, 297, 298, 299)
    image, video = load_processor_configs(empty, vision)
    assert (image.patch_size, image.min_pixels, image.max_pixels, image.image_std) == (4, 65536, 16777216,
                                                                                      (0.5,) * 3)
    assert (video.patch_size, video.fps, video.temporal_patch_size) == (4, 2.0, 2)
    (empty / "video_preprocessor_config.json").write_text(json.dumps(
        {"patch_size": 16, "fps": 1, "size": {"shortest_edge": 1000, "longest_edge": 90000},
         "cap_pixels_per_frame": True}))
    _, video = load_processor_configs(empty, vision)
    assert (video.patch_size, video.fps, video.min_pixels, video.max_pixels, video.cap_pixels_per_frame) == (
        16, 1, 1000, 90000, True)


def test_smart_resize_equals_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as ref_image
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as ref_video

    rng = random.Random(0)
    cases = [(48, 80), (80, 48), (16, 16), (1, 1), (200, 1), (4000, 3000), (1080, 1920), (33, 1000)]
    cases += [(rng.randint(1, 3000), rng.randint(1, 3000)) for _ in range(300)]
    for h, w in cases:
        if max(h, w) / min(h, w) > 200:
            continue
        for lo, hi in [(65536, 16777216), (4096, 65536), (3136, 1003520)]:
            assert smart_resize(h, w, 32, lo, hi) == ref_image(h, w, 32, lo, hi), (h, w, lo, hi)
        for n in [2, 3, 8, 31]:
            want = ref_video(n, h, w, temporal_factor=2, factor=32, min_pixels=4096, max_pixels=400000)
            assert smart_resize_video(n, h, w, 32, 2, 4096, 400000) == want, (n, h, w)
    # round half to even: 48 / 32 = 1.5 -> 2, 80 / 32 = 2.5 -> 2
    assert smart_resize(48, 80, 32, 1, 10**9) == (64, 64)
    assert smart_resize(200, 1, 32, 1, 10**9)[1] == 32  # aspect exactly 200 is accepted
    with pytest.raises(InvalidParameterError) as err:
        smart_resize(201, 1, 32, 1, 10**9)
    assert err.value.param == "image" and "aspect ratio" in str(err.value)


# ---- video -------------------------------------------------------------------------------------------
def test_frame_sampling_and_timestamps_equal_transformers():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    cfg = VideoProcessorConfig()
    clips = [(300, 30.0, 2.0), (10, 24.0, 2.0), (7, 1.0, 2.0), (1000, 25.0, 0.5), (3, 30, 2)]
    for total, video_fps, fps in clips:
        fake = SimpleNamespace(fps=cfg.fps, min_frames=cfg.min_frames, max_frames=cfg.max_frames)
        want = Qwen3VLVideoProcessor.sample_frames(fake, VideoMetadata(total, fps=video_fps), fps=fps)
        got = sample_frame_indices(total, video_fps, cfg, fps)
        assert got.tolist() == want.tolist()
        times = Qwen3VLProcessor._calculate_timestamps(None, list(want), video_fps, 2)
        assert group_timestamps(got, video_fps, 2) == times
    # the processor's text for a video: per group "<x.y seconds>" then vision start, placeholders, end
    fake = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
                           _calculate_timestamps=lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a),
                           vision_start_token="<vs>", video_token="<v>", vision_end_token="<ve>")
    indices = [0, 15, 30, 45, 60]
    inputs = {"video_grid_thw": torch.tensor([[3, 4, 6]]),
              "video_metadata": [VideoMetadata(61, fps=30.0, frames_indices=list(indices))]}
    want = Qwen3VLProcessor.replace_video_token(fake, inputs, 0)
    got = "".join(timestamp_text(t) + "<vs>" + "<v>" * 6 + "<ve>" for t in group_timestamps(indices, 30.0, 2))
    assert got == want and want.startswith("<0.2 seconds>")


def _video_reference(frames: list[np.ndarray], size: tuple[int, int], cfg: VideoProcessorConfig):
    """Each frame through the PIL image processor's own resize/rescale/normalize, then the Qwen3-VL video
    processor's patchify (odd frame counts padded with the last frame)."""
    from transformers import Qwen2VLImageProcessorPil
    from transformers.image_processing_backends import PilBackend
    from transformers.image_utils import SizeDict
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    proc = Qwen2VLImageProcessorPil()
    out = []
    for f in frames:
        chw = np.moveaxis(f, -1, 0)
        chw = PilBackend.resize(proc, chw, SizeDict(height=size[0], width=size[1]), resample=cfg.resample)
        chw = proc.normalize(proc.rescale(chw, cfg.rescale_factor), list(cfg.image_mean), list(cfg.image_std))
        out.append(torch.from_numpy(chw))
    videos = torch.stack(out)[None]
    patches, t, h, w = Qwen3VLVideoProcessor.patchify(None, videos, cfg.patch_size, cfg.merge_size,
                                                      cfg.temporal_patch_size)
    return patches[0], (t, h, w)


@pytest.mark.parametrize("count", [6, 5, 1])
def test_video_groups_equal_reference_layout(count):
    cfg = VideoProcessorConfig(patch_size=8, min_pixels=2 * 16 * 16, max_pixels=12 * 64 * 48)
    frames = [_image(45, 70, seed=i) for i in range(count)]
    groups = preprocess_video(frames, cfg, fps=2.0)  # already sampled at 2 fps
    n = max(count, 2)
    size = smart_resize_video(n, 45, 70, 16, 2, cfg.min_pixels, cfg.max_pixels)
    want, (t, h, w) = _video_reference(frames, size, cfg)
    assert len(groups) == t == (count + 1) // 2
    assert all((g.grid.t, g.grid.h, g.grid.w) == (1, h, w) for g in groups)
    assert torch.equal(torch.cat([g.pixel_values for g in groups]), want)
    assert [g.timestamp for g in groups] == group_timestamps(list(range(count)), 2.0, 2)
    # frames 0 and 1 at 2 fps: 0.25 s, written with one decimal; a single frame (repeated) is at 0 s
    assert groups[0].text == ("<0.2 seconds>" if count > 1 else "<0.0 seconds>")
    assert groups[0].tokens == (h // 2) * (w // 2)
    assert (groups[0].vision_run.rows, groups[0].vision_run.cols) == (h // 2, w // 2)


def test_video_sampling_and_budget():
    cfg = VideoProcessorConfig(patch_size=8, min_pixels=16 * 16, max_pixels=20 * 32 * 32)
    frames = np.stack([_image(40, 60, seed=i) for i in range(30)])  # a [T, H, W, 3] array at 10 fps
    groups = preprocess_video(frames, cfg, video_fps=10.0, fps=2.0)
    indices = sample_frame_indices(30, 10.0, cfg, 2.0)
    assert len(indices) == 6 and len(groups) == 3
    assert [g.timestamp for g in groups] == group_timestamps(indices, 10.0, 2)
    h, w = smart_resize_video(6, 40, 60, 16, 2, cfg.min_pixels, cfg.max_pixels)
    assert (groups[0].grid.h, groups[0].grid.w) == (h // 8, w // 8)
    # sampled frames only: group 1 is frames indices[2], indices[3]
    alone = preprocess_video([frames[i] for i in indices], cfg, fps=2.0)
    assert all(torch.equal(a.pixel_values, b.pixel_values) for a, b in zip(alone, groups, strict=True))
    # the per-frame cap: each frame's share of the budget is capped
    capped = VideoProcessorConfig(patch_size=8, min_pixels=16, max_pixels=10**7, cap_pixels_per_frame=True,
                                  max_video_tokens=4)
    assert video_max_pixels(capped, 6) == 4 * 16 * 16 * 6
    assert video_max_pixels(cfg, 6) == cfg.max_pixels


def test_stream_groups_have_a_fixed_budget():
    cfg = VideoProcessorConfig(patch_size=8, min_pixels=16 * 16, max_pixels=64 * 64 * 8,
                               stream_pixels_per_frame=48 * 48)
    big, small = _image(300, 400, seed=1), _image(30, 40, seed=2)
    g = preprocess_frames([big, big], 3.25, cfg)
    assert g.text == "<3.2 seconds>" and g.timestamp == 3.25
    assert g.grid.h * g.grid.w * 8 * 8 <= 48 * 48  # the budget holds whatever the source size
    other = preprocess_frames([_image(30, 40, 3)] * 2, 9, cfg)
    assert preprocess_frames([small, small], 0.0, cfg).grid == other.grid
    # one frame fills its group by repetition
    assert torch.equal(preprocess_frames([big], 1.0, cfg).pixel_values, g.pixel_values)
    # the default budget: the capped per-frame share of one frame group
    default = VideoProcessorConfig()
    assert default.stream_budget() == 32 * 32 * 768 // 2
    assert preprocess_frames([_image(720, 1280, 4)], 0.0, default).tokens <= 768 // 2


def test_placeholders():
    vision = VisionConfig("qwen3_5", 1, 8, 16, 2, 3, 4, 2, 2, 16, 16, "gelu", 1e4, (), 296, 297, 298, 299)
    assert placeholder_ids(vision, 3) == [298, 296, 296, 296, 299]
    assert placeholder_ids(vision, 2, video=True) == [298, 297, 297, 299]


# ---- bad input -----------------------------------------------------------------------------------------
def _refused(param: str, call, *args, match: str | None = None, **kwargs) -> InvalidParameterError:
    with pytest.raises(InvalidParameterError, match=match) as err:
        call(*args, **kwargs)
    assert err.value.param == param and isinstance(err.value, ValueError)
    return err.value


def test_bad_images_are_refused(tmp_path):
    cfg = ImageProcessorConfig(patch_size=16, min_pixels=4096, max_pixels=1 << 20, max_image_tokens=100)
    png = io.BytesIO()
    Image.fromarray(_image(64, 64, 0)).save(png, format="PNG")
    _refused("image", preprocess_image, b"\x89PNG\r\n\x1a\n" + b"\x00" * 50, cfg, match="cannot decode")
    _refused("image", preprocess_image, png.getvalue()[:200], cfg, match="cannot decode")  # truncated
    _refused("image", preprocess_image, b"GIF89a not really", cfg, match="cannot decode")
    _refused("image", preprocess_image, b"plain text", cfg, match="cannot decode")
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8\xff garbage")
    _refused("image", preprocess_image, str(bad), cfg, match="cannot decode")
    _refused("image", preprocess_image, str(tmp_path / "missing.png"), cfg, match="no image file")
    _refused("image", preprocess_image, "https://example.com/cat.png", cfg, match="not fetched")
    _refused("image", preprocess_image, "data:image/png;base64,@@@", cfg, match="base64")
    _refused("image", preprocess_image, np.zeros((0, 5, 3), np.uint8), cfg, match="empty")
    _refused("image", preprocess_image, Image.new("RGB", (0, 0)), cfg, match="empty")
    _refused("image", preprocess_image, np.zeros((4, 4, 3), np.float32), cfg, match="uint8")
    _refused("image", preprocess_image, np.zeros((4, 4), np.uint8), cfg, match="HxWx3")
    _refused("image", preprocess_image, 42, cfg, match="PIL image")
    _refused("image", preprocess_image, np.zeros((2, 500, 3), np.uint8), cfg, match="aspect ratio 250")
    err = _refused("image", preprocess_image, _image(400, 400, 1), cfg, match="max_image_tokens=100")
    assert "144 tokens" in str(err)  # 400 / 32 = 12.5 rounds to 12: 384 x 384 pixels, 12 x 12 tokens
    assert preprocess_image(_image(320, 320, 1), cfg).tokens == 100  # at the limit: accepted


def test_bad_frames_are_refused():
    cfg = VideoProcessorConfig(patch_size=8, min_pixels=256, max_pixels=64 * 64 * 8)
    a, b = _image(40, 60, 1), _image(40, 62, 2)
    _refused("video", preprocess_video, [a, b, a], cfg, match="differ in size")
    _refused("video", preprocess_video, [], cfg, match="non-empty")
    _refused("video", preprocess_video, [a, b"junk"], cfg, match="cannot decode")
    _refused("video", preprocess_video, [a, a], cfg, fps=0.0, match="fps")
    _refused("frames", preprocess_frames, [a, b], 0.0, cfg, match="differ in size")
    _refused("frames", preprocess_frames, [a, a, a], 0.0, cfg, match="at most 2")
    _refused("frames", preprocess_frames, [], 0.0, cfg, match="non-empty")
    _refused("frames", preprocess_frames, a, 0.0, cfg, match="sequence")
    _refused("frames", preprocess_frames, [a], float("nan"), cfg, match="timestamp")
    _refused("frames", preprocess_frames, [np.zeros((1, 300, 3), np.uint8)], 0.0, cfg, match="aspect ratio")
    _refused("frames", load_rgb, "nope.png", "frames", match="no frames file")
