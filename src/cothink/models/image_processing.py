"""Pixels to patches for the vision tower, without torchvision (numpy + Pillow).

Images follow transformers' `Qwen2VLImageProcessorPil` step for step, so `pixel_values` and the grid are
equal to its output: convert to RGB (transparency composited onto white), resize with Pillow to
`smart_resize`'s size (both sides multiples of patch x merge, pixel count within [min, max]), rescale
(float64 product, then float32), normalise in float32, then lay the patches out as the tower reads them
(each 2x2 merge block's patches consecutive, one row of `C * tp * p * p` values per patch; an image is
repeated over the temporal patch).

Videos follow the Qwen3-VL video processor's rules: frames sampled at `fps` from the clip
(`sample_frame_indices`), one pixel budget over all sampled frames (`smart_resize_video`), frames padded
to a multiple of the temporal patch by repeating the last, and every group of `temporal_patch_size`
frames preceded in the text by its timestamp, the mean time of its first and last frame
(`timestamp_text`: "<1.2 seconds>"). Frames are resized with Pillow as images are (the reference resizes
videos with torchvision, whose bicubic filter differs from Pillow's by about one grey level). A live
stream has no known length: each group is resized under a fixed per-frame budget (`preprocess_frames`).

Bad input raises InvalidParameterError naming the caller's parameter ("image", "video" or "frames").
"""

from __future__ import annotations

import base64
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from cothink.errors import InvalidParameterError
from cothink.models.config import VisionConfig
from cothink.models.mrope import VisionRun
from cothink.models.vision import PatchGrid

# A PIL image, an HxWx3 uint8 array, a local file path, encoded bytes, or a data: URL (base64).
ImageLike = Image.Image | np.ndarray | str | Path | bytes

MAX_ASPECT_RATIO = 200  # the reference refuses longer/shorter > 200
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageProcessorConfig:
    """`preprocessor_config.json` of a checkpoint (defaults: `Qwen2VLImageProcessorPil`'s own)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56  # size.shortest_edge
    max_pixels: int = 28 * 28 * 1280  # size.longest_edge
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    max_image_tokens: int | None = None  # refuse images that would need more tokens (None: no limit)

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class VideoProcessorConfig:
    """`video_preprocessor_config.json` of a checkpoint (defaults: `Qwen3VLVideoProcessor`'s own)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32  # size.shortest_edge: over all sampled frames
    max_pixels: int = 32 * 32 * 768  # size.longest_edge: over all sampled frames
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC
    fps: float = 2.0  # frames sampled per second of video
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False  # qwen-vl-utils' per-frame cap (see smart_resize_video)
    max_video_tokens: int = 768  # the per-frame token ceiling of that cap
    stream_pixels_per_frame: int | None = None  # a live stream's fixed budget; None: see stream_budget

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def stream_budget(self) -> int:
        """Pixels per frame of a live stream: the per-frame budget the capped rule gives a clip of one
        frame group, unless set."""
        if self.stream_pixels_per_frame is not None:
            return self.stream_pixels_per_frame
        cap = self.max_video_tokens * self.factor**2
        return max(min(cap, self.max_pixels // self.temporal_patch_size), int(self.min_pixels * 1.05))


def _size_limits(raw: dict[str, Any]) -> dict[str, int]:
    """min/max pixels from `size` {shortest_edge, longest_edge}; top-level min_pixels/max_pixels win."""
    out: dict[str, int] = {}
    size = raw.get("size") or {}
    if "shortest_edge" in size:
        out["min_pixels"] = int(size["shortest_edge"])
    if "longest_edge" in size:
        out["max_pixels"] = int(size["longest_edge"])
    for key in ("min_pixels", "max_pixels"):
        if raw.get(key) is not None:
            out[key] = int(raw[key])
    return out


_COMMON_KEYS = ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "resample")


def _common(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: raw[k] for k in _COMMON_KEYS if raw.get(k) is not None}
    for key in ("image_mean", "image_std"):
        if raw.get(key) is not None:
            value = raw[key]
            out[key] = tuple(float(v) for v in (value if isinstance(value, (list, tuple)) else [value] * 3))
    return {**out, **_size_limits(raw)}


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def load_processor_configs(
    folder: str | Path, vision: VisionConfig | None = None
) -> tuple[ImageProcessorConfig, VideoProcessorConfig]:
    """The image and video preprocessing of a checkpoint folder.

    Keys present in `preprocessor_config.json` / `video_preprocessor_config.json` override the
    processors' class defaults, as transformers reads them. A folder without them gets the released
    Qwen3-VL/Qwen3.5 values (mean = std = 0.5, 65,536..16,777,216 pixels) with the patch geometry of
    `vision`."""
    folder = Path(folder)
    raw_image = _read_json(folder / "preprocessor_config.json")
    raw_video = _read_json(folder / "video_preprocessor_config.json")
    geometry: dict[str, Any] = {}
    if vision is not None:
        geometry = dict(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                        merge_size=vision.spatial_merge_size)
    if raw_image is None:
        image = ImageProcessorConfig(**geometry, min_pixels=65536, max_pixels=16777216,
                                     image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))
    else:
        flags = {k: bool(raw_image[k]) for k in ("do_resize", "do_rescale", "do_normalize") if k in raw_image}
        image = ImageProcessorConfig(**_common(raw_image), **flags)
    if raw_video is None:
        video = VideoProcessorConfig(**geometry)
    else:
        extra_keys = ("fps", "min_frames", "max_frames", "cap_pixels_per_frame", "max_video_tokens")
        extra = {k: raw_video[k] for k in extra_keys if raw_video.get(k) is not None}
        video = VideoProcessorConfig(**_common(raw_video), **extra)
    return image, video


# ---- sizes -------------------------------------------------------------------------------------------
def _check_aspect(height: int, width: int, param: str) -> None:
    if height <= 0 or width <= 0:
        raise InvalidParameterError(f"the {param} is empty ({width}x{height} pixels)", param=param)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidParameterError(
            f"the {param}'s aspect ratio {max(height, width) / min(height, width):.1f} is over "
            f"{MAX_ASPECT_RATIO} ({width}x{height} pixels)", param=param)


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int, *, param: str = "image"
) -> tuple[int, int]:
    """The image's resized (height, width): multiples of `factor`, pixel count within [min, max], the
    aspect ratio kept as closely as possible (sides rounded half to even, as Python's round does)."""
    _check_aspect(height, width, param)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_video(
    num_frames: int, height: int, width: int, factor: int, temporal_factor: int, min_pixels: int,
    max_pixels: int, *, param: str = "video",
) -> tuple[int, int]:
    """Every frame's resized (height, width) when `num_frames` frames share one pixel budget.

    Frames smaller than `factor` on a side are first scaled up to it; the budget counts the frame count
    rounded to a multiple of `temporal_factor`."""
    _check_aspect(height, width, param)
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
        _check_aspect(height, width, param)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_max_pixels(cfg: VideoProcessorConfig, num_frames: int) -> int:
    """The pixel budget over `num_frames` sampled frames; with `cap_pixels_per_frame`, each frame's share
    is capped at `max_video_tokens` tokens and floored at 1.05 x min_pixels."""
    if not cfg.cap_pixels_per_frame:
        return cfg.max_pixels
    cap = cfg.max_video_tokens * cfg.factor**2
    return max(min(cap, cfg.max_pixels // num_frames), int(cfg.min_pixels * 1.05)) * num_frames


# ---- decoding ------------------------------------------------------------------------------------------
def _open(data: bytes | Path, param: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
        image.load()  # decode now: truncated or corrupt data fails here, not later
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        source = "bytes" if isinstance(data, bytes) else str(data)
        raise InvalidParameterError(f"cannot decode the {param} ({source[:80]}): {exc}", param=param) from exc
    return image


def _from_string(text: str, param: str) -> Image.Image:
    if text.startswith("data:"):
        header, _, payload = text.partition(",")
        if not header.endswith(";base64"):
            raise InvalidParameterError(f"the {param} data URL is not base64", param=param)
        try:
            raw = base64.b64decode(payload, validate=True)
        except ValueError as exc:
            raise InvalidParameterError(f"the {param} data URL is not valid base64", param=param) from exc
        return _open(raw, param)
    if "://" in text:
        raise InvalidParameterError(f"remote {param} URLs are not fetched; pass the bytes", param=param)
    path = Path(text)
    if not path.is_file():
        raise InvalidParameterError(f"no {param} file at {text!r}", param=param)
    return _open(path, param)


def _pil_to_rgb(image: Image.Image) -> np.ndarray:
    """As transformers' convert_to_rgb: transparency is composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.array(Image.alpha_composite(white, rgba).convert("RGB"))
    return np.array(image.convert("RGB"))


def load_rgb(image: ImageLike, param: str = "image") -> np.ndarray:
    """Any accepted input -> an HxWx3 uint8 array (RGB)."""
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise InvalidParameterError(
                f"a {param} array must be HxWx3 uint8, got shape {image.shape} {image.dtype}", param=param)
        return np.ascontiguousarray(image)
    if isinstance(image, (str, Path)):
        image = _from_string(str(image), param)
    elif isinstance(image, (bytes, bytearray, memoryview)):
        image = _open(bytes(image), param)
    elif not isinstance(image, Image.Image):
        raise InvalidParameterError(
            f"a {param} must be a PIL image, an HxWx3 uint8 array, a file path or bytes; "
            f"got {type(image).__name__}", param=param)
    if image.width == 0 or image.height == 0:
        raise InvalidParameterError(
            f"the {param} is empty ({image.width}x{image.height} pixels)", param=param)
    try:
        return _pil_to_rgb(image)
    except (OSError, ValueError) as exc:
        raise InvalidParameterError(f"cannot convert the {param} to RGB: {exc}", param=param) from exc


# ---- pixels --------------------------------------------------------------------------------------------
def _resize_normalize(
    rgb: np.ndarray, size: tuple[int, int] | None, resample: int, rescale: float | None,
    mean: tuple[float, ...] | None, std: tuple[float, ...] | None,
) -> np.ndarray:
    """HxWx3 uint8 -> 3xH'xW' float32: Pillow resize, rescale (float64 then float32), normalise (float32),
    in the reference's order and precision."""
    if size is not None:
        h, w = size
        rgb = np.array(Image.fromarray(rgb).resize((w, h), resample=resample))
    chw = np.moveaxis(rgb, -1, 0)
    pixels = (chw.astype(np.float64) * rescale).astype(np.float32) if rescale is not None else chw
    if mean is not None and std is not None:
        if not np.issubdtype(pixels.dtype, np.floating):
            pixels = pixels.astype(np.float32)
        m, s = np.array(mean, dtype=pixels.dtype), np.array(std, dtype=pixels.dtype)
        pixels = ((pixels.T - m) / s).T
    return np.asarray(pixels, dtype=np.float32)


def patchify(frames: np.ndarray, patch_size: int, merge_size: int) -> np.ndarray:
    """frames [tp, C, H, W] (one temporal patch) -> [gh * gw, C * tp * p * p]: rows in merge-block order
    (block row, block column, row in block, column in block), values in (C, t, ph, pw) order."""
    tp, c, h, w = frames.shape
    p, m = patch_size, merge_size
    gh, gw = h // p, w // p
    x = frames.reshape(tp, c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(2, 5, 3, 6, 1, 0, 4, 7)  # (gh/m, gw/m, m, m, C, tp, p, p)
    return np.ascontiguousarray(x).reshape(gh * gw, c * tp * p * p)


@dataclass(frozen=True)
class _GridPixels:
    """Patches of one grid of t = 1, ready for the tower: what an image and a frame group share."""

    pixel_values: torch.Tensor  # [grid.patches, C * tp * p * p] float32
    grid: PatchGrid  # t = 1
    merge_size: int

    @property
    def tokens(self) -> int:
        """Placeholder tokens in the text (one per merged 2x2 block)."""
        return self.grid.tokens(self.merge_size)

    @property
    def merged_rows(self) -> int:
        return self.grid.h // self.merge_size

    @property
    def merged_cols(self) -> int:
        return self.grid.w // self.merge_size

    @property
    def vision_run(self) -> VisionRun:
        """The placeholder run's geometry for the span rule (models/mrope.py)."""
        return VisionRun(self.merged_rows, self.merged_cols)


@dataclass(frozen=True)
class ImagePixels(_GridPixels):
    """One image, ready for the tower."""


@dataclass(frozen=True)
class FrameGroup(_GridPixels):
    """`temporal_patch_size` consecutive frames of a video or stream, encoded as one grid of t = 1."""

    timestamp: float  # seconds: the mean time of the group's first and last frame

    @property
    def text(self) -> str:
        """The timestamp text that precedes the group's vision-start token."""
        return timestamp_text(self.timestamp)


def preprocess_image(image: ImageLike, cfg: ImageProcessorConfig, *, param: str = "image") -> ImagePixels:
    """One image -> its patches and grid, equal to `Qwen2VLImageProcessorPil` under the same config."""
    rgb = load_rgb(image, param)
    h, w = rgb.shape[:2]
    if cfg.do_resize:
        size = smart_resize(h, w, cfg.factor, cfg.min_pixels, cfg.max_pixels, param=param)
    else:
        _check_aspect(h, w, param)
        if h % cfg.factor or w % cfg.factor:
            raise InvalidParameterError(
                f"without resizing, the {param}'s sides must be multiples of {cfg.factor}; got {w}x{h}",
                param=param)
        size = (h, w)
    tokens = (size[0] // cfg.factor) * (size[1] // cfg.factor)
    if cfg.max_image_tokens is not None and tokens > cfg.max_image_tokens:
        raise InvalidParameterError(
            f"the {param} ({w}x{h} pixels, resized to {size[1]}x{size[0]}) needs {tokens} tokens, over "
            f"max_image_tokens={cfg.max_image_tokens}", param=param)
    pixels = _resize_normalize(
        rgb, size if cfg.do_resize else None, cfg.resample, cfg.rescale_factor if cfg.do_rescale else None,
        cfg.image_mean if cfg.do_normalize else None, cfg.image_std if cfg.do_normalize else None)
    frames = np.broadcast_to(pixels[None], (cfg.temporal_patch_size, *pixels.shape))
    patches = patchify(frames, cfg.patch_size, cfg.merge_size)
    grid = PatchGrid(1, size[0] // cfg.patch_size, size[1] // cfg.patch_size)
    return ImagePixels(torch.from_numpy(patches), grid, cfg.merge_size)


# ---- video ---------------------------------------------------------------------------------------------
def sample_frame_indices(total_frames: int, video_fps: float, cfg: VideoProcessorConfig,
                         fps: float | None = None) -> np.ndarray:
    """Indices of the frames sampled from a clip of `total_frames` at `video_fps`: `fps` per second
    (default cfg.fps), at least min_frames and at most max_frames (and the clip), spread evenly."""
    fps = cfg.fps if fps is None else fps
    n = int(total_frames / video_fps * fps)
    n = min(max(n, cfg.min_frames), cfg.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, n).round().astype(int)


def group_timestamps(indices: Sequence[int], video_fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each frame group: the mean time of its first and last frame (the last frame repeats to
    fill the final group)."""
    idx = [int(i) for i in indices]
    if len(idx) % temporal_patch_size:
        idx += [idx[-1]] * (temporal_patch_size - len(idx) % temporal_patch_size)
    times = [i / video_fps for i in idx]
    firsts = range(0, len(times), temporal_patch_size)
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in firsts]


def timestamp_text(seconds: float) -> str:
    """The text before a frame group's vision-start token, as the Qwen3-VL processor writes it."""
    return f"<{seconds:.1f} seconds>"


def _frames_rgb(frames: Sequence[ImageLike] | np.ndarray, param: str) -> list[np.ndarray]:
    if isinstance(frames, np.ndarray) and frames.ndim == 4:
        frames = list(frames)
    if isinstance(frames, (str, bytes, Path, Image.Image, np.ndarray)) or len(frames) == 0:
        raise InvalidParameterError(f"{param} must be a non-empty sequence of frames", param=param)
    rgb = [load_rgb(f, param) for f in frames]
    sizes = {f.shape[:2] for f in rgb}
    if len(sizes) > 1:
        shown = sorted(f"{w}x{h}" for h, w in sizes)
        raise InvalidParameterError(f"the {param} frames differ in size ({', '.join(shown)})", param=param)
    return rgb


def _groups(rgb: list[np.ndarray], size: tuple[int, int], cfg: VideoProcessorConfig,
            timestamps: list[float]) -> list[FrameGroup]:
    tp = cfg.temporal_patch_size
    pixels = [_resize_normalize(f, size, cfg.resample, cfg.rescale_factor, cfg.image_mean, cfg.image_std)
              for f in rgb]
    pixels += [pixels[-1]] * (-len(pixels) % tp)  # pad the last group by repeating the last frame
    grid = PatchGrid(1, size[0] // cfg.patch_size, size[1] // cfg.patch_size)
    out = []
    for g, ts in zip(range(0, len(pixels), tp), timestamps, strict=True):
        patches = patchify(np.stack(pixels[g : g + tp]), cfg.patch_size, cfg.merge_size)
        out.append(FrameGroup(torch.from_numpy(patches), grid, cfg.merge_size, ts))
    return out


def preprocess_video(
    frames: Sequence[ImageLike] | np.ndarray, cfg: VideoProcessorConfig, *,
    video_fps: float | None = None, fps: float | None = None,
) -> list[FrameGroup]:
    """A clip -> its frame groups in order, each with its timestamp.

    With `video_fps` (the clip's frame rate), frames are sampled at `fps` (default cfg.fps) as the
    Qwen3-VL video processor samples them; without it the frames are taken as already sampled at `fps`.
    All frames must have one size; they share one pixel budget (smart_resize_video). A clip shorter than
    one frame group is budgeted as one group."""
    rgb = _frames_rgb(frames, "video")
    rate = cfg.fps if fps is None else fps
    if rate <= 0 or (video_fps is not None and video_fps <= 0):
        raise InvalidParameterError(f"fps must be positive (fps={fps}, video_fps={video_fps})", param="video")
    if video_fps is None:
        indices = np.arange(len(rgb))
        source_fps = rate
    else:
        indices = sample_frame_indices(len(rgb), video_fps, cfg, fps)
        source_fps = video_fps
    sampled = [rgb[i] for i in indices]
    n = max(len(sampled), cfg.temporal_patch_size)
    h, w = sampled[0].shape[:2]
    size = smart_resize_video(n, h, w, cfg.factor, cfg.temporal_patch_size, cfg.min_pixels,
                              video_max_pixels(cfg, n))
    return _groups(sampled, size, cfg, group_timestamps(indices, source_fps, cfg.temporal_patch_size))


def preprocess_frames(
    frames: Sequence[ImageLike] | np.ndarray, timestamp: float, cfg: VideoProcessorConfig
) -> FrameGroup:
    """One frame group of a live stream (1..temporal_patch_size frames of one size, the last repeated
    to fill the group) under the fixed per-frame budget `cfg.stream_budget()`; `timestamp` in seconds."""
    rgb = _frames_rgb(frames, "frames")
    if len(rgb) > cfg.temporal_patch_size:
        raise InvalidParameterError(
            f"a frame group holds at most {cfg.temporal_patch_size} frames, got {len(rgb)}", param="frames")
    if not math.isfinite(timestamp) or timestamp < 0:
        raise InvalidParameterError(f"timestamp must be a finite number of seconds >= 0, got {timestamp}",
                                    param="frames")
    tp = cfg.temporal_patch_size
    h, w = rgb[0].shape[:2]
    size = smart_resize_video(tp, h, w, cfg.factor, tp, cfg.min_pixels, cfg.stream_budget() * tp,
                              param="frames")
    return _groups(rgb, size, cfg, [float(timestamp)])[0]


def placeholder_ids(vision: VisionConfig, tokens: int, *, video: bool = False) -> list[int]:
    """vision-start, `tokens` image (or video) placeholders, vision-end: the ids of one image or one frame
    group in the text (a frame group's timestamp text goes before them)."""
    pad = vision.video_token_id if video else vision.image_token_id
    return [vision.vision_start_token_id, *([pad] * tokens), vision.vision_end_token_id]
