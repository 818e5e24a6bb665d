"""Images in requests: OpenAI chat `image_url` content parts and the session API's image fields.

Images arrive as `data:` URLs (base64); remote URLs are refused (the server fetches nothing). A chat
prompt with images is rendered with a per-request marker in place of each image, tokenized around
the markers, and written into its block piece by piece: text as token ids, each image through
`engine.extend(block, image=...)` (vision-start, placeholders, vision-end, the tower's features).
Such prompts skip the prefix cache: placeholder ids do not say which pixels they stand for.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from cothink.errors import InvalidParameterError
from cothink.memory.block import Block
from cothink.models.image_processing import load_rgb, placeholder_ids, preprocess_frames, preprocess_image
from cothink.server.errors import APIError

if TYPE_CHECKING:
    from cothink.runtime.engine import Engine
    from cothink.server.state import ServerState


def decode_image(url: Any, param: str) -> np.ndarray:
    """A data: URL (base64) -> an HxWx3 uint8 array; 400 naming `param` for anything else."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise APIError(400, "images must be sent as data: URLs (base64); remote URLs are not fetched",
                       "invalid_request_error", "unsupported_image_url", param)
    try:
        return load_rgb(url, "image")
    except InvalidParameterError as exc:
        raise APIError(400, str(exc), "invalid_request_error", "invalid_image", param) from None


@dataclass
class PromptImages:
    """The images of one chat prompt, in order, and the marker that stands for each in the text."""

    engine: Engine
    images: list[np.ndarray] = field(default_factory=list)
    fields: list[str] = field(default_factory=list)  # the request field of each image (for errors)
    nonce: str = field(default_factory=lambda: secrets.token_hex(8))
    # (image, first id, end) of each image in the expanded prompt, in the order the template placed them
    spans: list[tuple[int, int, int]] = field(default_factory=list)

    def add(self, part: Any, param: str) -> str:
        """An `image_url` content part -> the marker that takes its place in the message text."""
        vision = self.engine.runner.vision
        if vision is None:
            raise APIError(400, "this model has no vision tower: it cannot read images",
                           "invalid_request_error", "unsupported", param)
        url = part.get("url") if isinstance(part, dict) else None
        self.images.append(decode_image(url, f"{param}.image_url"))
        self.fields.append(f"{param}.image_url")
        return f"<cothink-image-{self.nonce}-{len(self.images) - 1}>"

    async def expand(self, state: ServerState, text: str, param: str) -> list[int]:
        """The rendered prompt's token ids with each marker replaced by its image's vision-start,
        placeholders and vision-end ids (as many as the image will take)."""
        vision = self.engine.runner.vision
        assert vision is not None
        processor = self.engine.image_processor()
        pieces = re.split(f"<cothink-image-{self.nonce}-(\\d+)>", text)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                ids.extend(await state.encode(piece, param) if piece else [])
                continue
            k = int(piece)
            try:
                pixels = await asyncio.to_thread(preprocess_image, self.images[k], processor)
            except InvalidParameterError as exc:
                raise APIError(
                    400, str(exc), "invalid_request_error", "invalid_image", self.fields[k]) from None
            self.spans.append((k, len(ids), len(ids) + pixels.tokens + 2))
            ids.extend(placeholder_ids(vision.config, pixels.tokens))
        return ids

    async def write(self, block: Block, ids: list[int], name: str) -> None:
        """Append the expanded prompt `ids` to `block`: text runs as token ids, images as images."""
        done = 0
        for k, start, stop in self.spans:
            if start > done:
                await self.engine.extend(block, token_ids=ids[done:start], priority="interactive", name=name)
            await self.engine.extend(block, image=self.images[k], priority="interactive", name=name)
            done = stop
        if done < len(ids):
            await self.engine.extend(block, token_ids=ids[done:], priority="interactive", name=name)


@dataclass(frozen=True)
class VisualInput:
    """An image or frame group of a session extend, decoded: what engine.extend takes, and how many
    tokens it will write (for the session's quotas)."""

    engine_input: dict[str, Any]  # image=..., or frames=... and timestamp=...
    tokens: int


async def visual_input(
    state: ServerState, image: str | None, frames: list[str] | None, timestamp: float | None
) -> VisualInput:
    """Decode a session extend's `image` or `frames` (data: URLs); 400 naming the field if unreadable."""
    engine = state.engine
    vision = engine.runner.vision
    param = "image" if image is not None else "frames"
    if vision is None:
        raise APIError(400, "this model has no vision tower: it cannot read images",
                       "invalid_request_error", "unsupported", param)
    try:
        if image is not None:
            array = decode_image(image, "image")
            pixels = await asyncio.to_thread(preprocess_image, array, engine.image_processor())
            return VisualInput({"image": array}, pixels.tokens + 2)
        arrays = [decode_image(f, f"frames.{i}") for i, f in enumerate(frames or [])]
        group = await asyncio.to_thread(preprocess_frames, arrays, float(timestamp or 0.0), vision.video)
    except InvalidParameterError as exc:
        raise APIError(400, str(exc), "invalid_request_error", "invalid_image", param) from None
    stamp = await state.encode(group.text, param)
    seconds = float(timestamp or 0.0)
    return VisualInput({"frames": arrays, "timestamp": seconds}, len(stamp) + group.tokens + 2)
