"""Vision: the tower's throughput against transformers', and interactive decode latency under a video stream.

    python bench/vision.py --model FOLDER            # a local Qwen3.5 multimodal or Qwen3-VL checkpoint
    python bench/vision.py --model tiny-vl-random    # a tiny random Qwen3.5 multimodal model (smoke runs)
    python bench/vision.py --model qwen35-vl-random  # the released tower's size (random weights), small text

Tower: --images random images of --size pixels, each preprocessed as the checkpoint says and encoded
alone, by cothink (``runner.vision.encode``, on its compute thread) and by transformers' own tower
(``model.model.visual``) on the same patches; vision tokens (merged placeholders) per second, best of
--repeats, the two alternating.

Decode under a stream: an interactive generation of --decode-tokens tokens after a short prompt, alone,
then while a background coroutine prefills text (512-token extends, one after another: the bound the
stream is held to), then while a background coroutine appends a live stream to its own block at --fps
frames per second (one ``extend(frames=[f0, f1], timestamp=...)`` per pair of frames, paced in real
time). Reported: the generation's inter-token latency (median, p90, max) in each run, and the text
tokens prefilled or frame groups encoded meanwhile.
Writes vision.json to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cothink  # noqa: E402  sets the OpenMP wait policy, so it precedes torch
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_common_args(p)
    p.add_argument("--images", type=int, default=4, help="images encoded per measurement (default 4)")
    p.add_argument("--size", default="480x640", help="image size HxW in pixels (default 480x640)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--fps", type=float, default=2.0, help="frames per second of the stream (default 2)")
    p.add_argument("--frame-size", default="240x320", help="stream frame size HxW (default 240x320)")
    return p.parse_args(argv)


# the released Qwen3.5 tower (vision.md: depth 27, hidden 1152, 16 heads, MLP 4304, 48x48 positions)
RELEASED_TOWER = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                      num_position_embeddings=2304)


def tiny_random_vl(released_tower: bool = False) -> Path:
    """A random Qwen3.5 multimodal checkpoint with the released pixel geometry (patch 16, merge 2): a tiny
    tower, or (`released_tower`) the released tower's size under a small text stack (hidden 512)."""
    import transformers as tf

    from cothink.models.hub import resolve_model_path

    folder = Path(tempfile.mkdtemp(prefix="cothink-bench-vl-"))
    torch.manual_seed(0)
    hidden = 512 if released_tower else 64
    text = dict(vocab_size=49152, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                max_position_embeddings=8192, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [4, 2, 2], "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=hidden,
                  patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64)
    if released_tower:
        vision |= RELEASED_TOWER
    ids = dict(image_token_id=49148, video_token_id=49149, vision_start_token_id=49150,
               vision_end_token_id=49151, tie_word_embeddings=True)
    config = tf.Qwen3_5Config(text_config=text, vision_config=vision, **ids)
    model = tf.Qwen3_5ForConditionalGeneration(config)
    model.save_pretrained(folder)
    src = Path(resolve_model_path("smollm2"))
    for f in src.iterdir():
        if f.name.startswith("tokenizer"):
            (folder / f.name).write_bytes(f.read_bytes())
    return folder


def _size(text: str) -> tuple[int, int]:
    h, w = text.lower().split("x")
    return int(h), int(w)


def _images(n: int, size: tuple[int, int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (*size, 3), dtype=np.uint8) for _ in range(n)]


def bench_tower(folder: Path, args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    from cothink.models.image_processing import preprocess_image

    runner = cothink.load_model(folder, dtype=dtype)
    vision = runner.vision
    assert vision is not None, f"{folder} has no vision tower"
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=dtype, local_files_only=True).eval()
    pixels = [preprocess_image(im, vision.image) for im in _images(args.images, _size(args.size), args.seed)]
    tokens = sum(p.tokens for p in pixels)

    def ours() -> None:
        for p in pixels:
            vision.encode(p.pixel_values.to(dtype), p.grid)

    @torch.inference_mode()
    def theirs() -> None:
        for p in pixels:
            hf.model.visual(p.pixel_values.to(dtype), grid_thw=torch.tensor([[1, p.grid.h, p.grid.w]]))

    best = {"cothink": float("inf"), "transformers": float("inf")}
    for _ in range(args.repeats):
        for name, fn in (("cothink", ours), ("transformers", theirs)):
            seconds, _ = C.timed(C.on_compute, fn)
            best[name] = min(best[name], seconds)
    return {
        "images": args.images, "size": args.size, "vision_tokens": tokens,
        "cothink_tokens_per_s": tokens / best["cothink"],
        "transformers_tokens_per_s": tokens / best["transformers"],
        "ratio": C.ratio(best["transformers"], best["cothink"]),
    }


LOADS = ("alone", "text", "stream")  # what runs in the background while the generation decodes


async def _decode(engine: Any, n: int, load: str, fps: float, frame_size: tuple[int, int]) -> dict:
    ctx, out = engine.block("ctx"), engine.block("out")
    await engine.extend(ctx, token_ids=list(range(100, 116)))
    stamps: list[float] = []
    groups = prefilled = 0
    done = asyncio.Event()

    async def camera() -> None:
        nonlocal groups
        block = engine.block("camera")
        t0 = time.perf_counter()
        while not done.is_set():
            frames = _images(2, frame_size, groups)
            await engine.extend(block, frames=frames, timestamp=2 * groups / fps, name="camera")
            groups += 1
            await asyncio.sleep(max(0.0, t0 + 2 * groups / fps - time.perf_counter()))

    async def reader() -> None:  # background text prefill: 512-token extends, one after another
        nonlocal prefilled
        block = engine.block("reader")
        while not done.is_set():
            if len(block) > 4096:
                engine.truncate(block, 0)
            ids = [100 + (prefilled + i) % 1000 for i in range(512)]
            await engine.extend(block, token_ids=ids, name="reader")
            prefilled += 512

    background = {"alone": None, "text": reader, "stream": camera}[load]
    task = asyncio.create_task(background()) if background is not None else None
    gen = engine.generate([ctx, out], max_tokens=n, priority="interactive", stop_at_eos=False, name="talker")
    async for _ in gen:
        stamps.append(time.perf_counter())
    done.set()
    if task is not None:
        await task
    gaps = [b - a for a, b in zip(stamps, stamps[1:])] or [0.0]
    return {"load": load, "tokens": len(stamps), "frame_groups": groups, "text_tokens_prefilled": prefilled,
            "itl_median_ms": 1e3 * statistics.median(gaps),
            "itl_p90_ms": 1e3 * sorted(gaps)[int(0.9 * (len(gaps) - 1))], "itl_max_ms": 1e3 * max(gaps)}


def bench_decode(folder: Path, args: argparse.Namespace, dtype: torch.dtype) -> list[dict[str, Any]]:
    rows = []
    for load in LOADS:
        engine = cothink.Engine.from_pretrained(folder, dtype=dtype)

        async def main(engine=engine, load=load) -> dict:
            async with engine:
                return await _decode(engine, args.decode_tokens, load, args.fps, _size(args.frame_size))

        rows.append(asyncio.run(main()))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    named = args.model if args.model in ("tiny-vl-random", "qwen35-vl-random") else None
    if named:
        args.model = str(tiny_random_vl(released_tower=named == "qwen35-vl-random"))
    info, folder = C.begin(args, "vision")
    dtype = torch.float32
    tower = bench_tower(folder, args, dtype)
    print(f"tower: {tower['vision_tokens']} vision tokens from {args.images} images of {args.size}: "
          f"cothink {C.fmt(tower['cothink_tokens_per_s'])} tokens/s, transformers "
          f"{C.fmt(tower['transformers_tokens_per_s'])} tokens/s ({C.fmt(tower['ratio'], 2)}x)")
    decode = bench_decode(folder, args, dtype)
    for row in decode:
        what = {
            "alone": "alone",
            "text": f"with a background text prefill ({row['text_tokens_prefilled']} tokens)",
            "stream": f"with a {args.fps:g} fps stream ({row['frame_groups']} groups)",
        }[row["load"]]
        print(f"interactive decode {what}: inter-token median {C.fmt(row['itl_median_ms'], 2)} ms, "
              f"p90 {C.fmt(row['itl_p90_ms'], 2)} ms, max {C.fmt(row['itl_max_ms'], 2)} ms")
    model = named or args.model
    C.write_json(args.out / "vision.json",
                 {"machine": info, "model": model, "dtype": "float32", "tower": tower, "decode": decode})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
