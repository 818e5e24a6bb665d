"""Images over HTTP: OpenAI chat `image_url` parts (data: URLs only) and the session API's image and
frame-group extends give what the engine gives for the same input; bad images are 400s naming the field."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image
from support import running_server, tiny_vision_folder

import cothink
from cothink.client import AsyncClient, data_url
from cothink.server import ServerSettings

BANNED = {str(t): -100 for t in (296, 297, 298, 299)}  # no placeholder ids in the output


def _png(h: int, w: int, seed: int) -> tuple[np.ndarray, str]:
    array = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return array, "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def folder():
    return tiny_vision_folder("qwen35_vl")


@pytest.fixture(scope="module")
def server(folder):
    engine = cothink.Engine.from_pretrained(folder)
    with running_server(engine, ServerSettings(model_name="tiny")) as srv:
        yield srv


def _direct(folder, pieces: list, max_tokens: int) -> tuple[list[int], list[float]]:
    """The same prompt through the engine: text pieces as text, images as images; greedy tokens and
    their log-probabilities."""
    engine = cothink.Engine.from_pretrained(folder)

    async def main():
        async with engine:
            block = engine.block()
            for piece in pieces:
                if isinstance(piece, str):
                    await engine.extend(block, text=piece)
                else:
                    await engine.extend(block, image=piece)
            gen = engine.generate(block, max_tokens=max_tokens, stop_at_eos=False, logprobs=0,
                                  banned_token_ids=[296, 297, 298, 299])
            pieces_out = [p async for p in gen]
            return ([t for p in pieces_out for t in p.token_ids],
                    [lp.logprob for p in pieces_out for lp in p.logprobs])

    return asyncio.run(main())


def test_chat_image_part_equals_the_engine(server, folder):
    array, url = _png(40, 16, 1)
    body = {
        "model": "tiny", "max_tokens": 5, "temperature": 0, "logprobs": True, "logit_bias": BANNED,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Look "},
                                                  {"type": "image_url", "image_url": {"url": url}},
                                                  {"type": "text", "text": " now"}]}],
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    # the server renders a template-less conversation as "role: content" lines
    tokens, logprobs = _direct(folder, ["user: Look ", array, " now\nassistant: "], 5)
    got = [c["logprob"] for c in out["choices"][0]["logprobs"]["content"]]
    assert len(got) == len(tokens) == out["usage"]["completion_tokens"]
    assert max(abs(a - b) for a, b in zip(got, logprobs)) < 1e-5
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    text = len(tok.encode("user: Look ")) + len(tok.encode(" now\nassistant: "))
    assert out["usage"]["prompt_tokens"] == text + 2 + 10  # vision start/end and 5 x 2 placeholders


@pytest.mark.parametrize("url,code", [
    ("https://example.com/cat.png", "unsupported_image_url"),
    ("data:image/png;base64,bm90IGFuIGltYWdl", "invalid_image"),
    (None, "unsupported_image_url"),
])
def test_chat_bad_image_parts_are_400_naming_the_field(server, url, code):
    body = {"model": "tiny", "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Look"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages.0.content.1.image_url" and error["code"] == code


def test_session_image_and_frames(server, folder):
    array, _ = _png(24, 24, 3)
    frames = [_png(24, 24, 4)[0], _png(24, 24, 5)[0]]

    async def main():
        async with AsyncClient(server.url) as client:
            async with await client.session("vision") as s:
                block = await s.block("See: ")
                ref = await s.extend(block, image=array)
                assert ref.length == 5 + 2 + 9
                ref = await s.extend(block, frames=frames, timestamp=1.5)
                assert ref.length == 16 + len("<1.5 seconds>") + 2 + 9  # 24 x 24 frames: 3 x 3 tokens
                result = await s.generate([block], max_tokens=3, stop_at_eos=False)
                with pytest.raises(Exception) as err:
                    await s.extend(block, image="https://example.com/x.png")
                assert getattr(err.value, "status", None) == 400
                return result["token_ids"]

    got = asyncio.run(main())
    engine = cothink.Engine.from_pretrained(folder)

    async def direct():
        async with engine:
            block = engine.block()
            await engine.extend(block, text="See: ")
            await engine.extend(block, image=array)
            await engine.extend(block, frames=frames, timestamp=1.5)
            return (await engine.generate(block, max_tokens=3, stop_at_eos=False).collect()).token_ids

    assert got == asyncio.run(direct())
    assert data_url(array).startswith("data:")
