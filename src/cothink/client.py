"""A small Python client for the cothink session API (``cothink serve``), sync and async, over httpx.

    from cothink.client import Client

    with Client("http://127.0.0.1:8000", api_key=None) as client:
        s = client.session()
        prompt = s.block("The sky is blue because")
        out = s.block()
        for event in s.stream([prompt, out], max_tokens=32):
            if event["type"] == "token":
                print(event["text"], end="", flush=True)
        print(s.probe([prompt, out], " Is this correct? Answer:"))

`AsyncClient` has the same methods, as coroutines (and `stream` as an async iterator). For the
OpenAI-compatible routes use the official `openai` package with ``base_url=<server>/v1``.

One core, two transports: `ClientCalls` and `SessionCalls` say what each method asks of the server and
how its answer is read, as a `Call` (no I/O). `Client`/`Session` send a call with `httpx.Client`,
`AsyncClient`/`AsyncSession` with `httpx.AsyncClient`; each public method is the core's builder wrapped
by its transport (`_sync_method` / `_async_method`), so a method is written once.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, Union

import httpx

__all__ = ["AsyncClient", "AsyncSession", "BlockRef", "Client", "ClientError", "Session"]

T = TypeVar("T")


class ClientError(Exception):
    """The server answered with an error: HTTP `status`, OpenAI-style `type` and `code`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
    ):
        super().__init__(f"{status} {code or type or 'error'}: {message}")
        self.status, self.message, self.type, self.code = status, message, type, code
        self.param = param  # the request field at fault, when the server names it


@dataclass
class BlockRef:
    """A block as the server last described it."""

    id: str
    length: int = 0
    name: str | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    writer: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def parse(cls, data: dict[str, Any]) -> BlockRef:
        return cls(
            data["id"],
            data.get("length", 0),
            data.get("name"),
            data.get("text"),
            data.get("token_ids"),
            data.get("writer"),
            data,
        )


BlockLike = Union[BlockRef, str]


def _id(block: BlockLike) -> str:
    return block.id if isinstance(block, BlockRef) else str(block)


def _view(view: Sequence[BlockLike] | BlockLike) -> list[str]:
    if isinstance(view, (BlockRef, str)):
        return [_id(view)]
    return [_id(b) for b in view]


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        err = response.json()["error"]
        raise ClientError(
            response.status_code, err.get("message", ""), err.get("type"), err.get("code"), err.get("param")
        )
    except (ValueError, KeyError, TypeError):
        raise ClientError(response.status_code, response.text) from None


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _sse_data(line: str) -> dict[str, Any] | None:
    """The event on one SSE line: None for other lines and for the closing ``[DONE]``."""
    if line.startswith("data: "):
        data = line[6:]
        if data != "[DONE]":
            return json.loads(data)
    return None


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _unchanged(data: Any) -> Any:
    return data


def _nothing(data: Any) -> None:
    return None


def _blocks(data: dict[str, Any]) -> list[BlockRef]:
    return [BlockRef.parse(b) for b in data["data"]]


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One request and how its JSON answer becomes the method's result; a transport sends it."""

    method: str
    path: str  # relative to the client's base URL
    json: Any = None  # the body; None sends none
    params: dict[str, Any] | None = None  # the query string
    parse: Callable[[Any], T] = _unchanged  # the answer's JSON -> the result

    @property
    def content(self) -> dict[str, Any]:
        """The body and query, as httpx's keyword arguments."""
        return {"json": self.json, "params": self.params}


# ================================================================================================ core


class ClientCalls:
    """The client's requests (no I/O). A transport sets `http_type` (the httpx client it sends with)
    and `session_type`, and sends each `Call`."""

    http_type: type[httpx.Client] | type[httpx.AsyncClient]
    session_type: Callable[[Any, dict[str, Any]], Any]

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        timeout: float | None = 120.0,
        http: httpx.Client | httpx.AsyncClient | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.http = http or self.http_type(base_url=self.base_url, headers=_headers(api_key), timeout=timeout)

    def _open(self, info: dict[str, Any]) -> Any:
        return self.session_type(self, info)

    def health(self) -> Call[dict[str, Any]]:
        return Call("GET", "/health")

    def models(self) -> Call[list[str]]:
        return Call("GET", "/v1/models", parse=lambda data: [m["id"] for m in data["data"]])

    def session(self, name: str | None = None) -> Call[Any]:
        """A new session."""
        return Call("POST", "/v1/sessions", json=_clean({"name": name}), parse=self._open)

    def restore(self, snapshot: str, name: str | None = None) -> Call[Any]:
        """A new session from a snapshot (`Session.snapshot()`); its blocks keep their ids
        (`session.restored_blocks`)."""
        body = _clean({"snapshot": snapshot, "name": name})
        return Call("POST", "/v1/sessions/restore", json=body, parse=self._open)

    def snapshots(self) -> Call[list[dict[str, Any]]]:
        """This key's snapshots: id, status (complete / writing / unfinished), created, bytes, ..."""
        return Call("GET", "/v1/sessions/snapshots")

    def delete_snapshot(self, snapshot: str) -> Call[None]:
        return Call("DELETE", f"/v1/sessions/snapshots/{snapshot}", parse=_nothing)


class SessionCalls:
    """A server session's requests (no I/O): blocks and coroutines private to it. Delete it (or use
    `with`) when done."""

    def __init__(self, client: Any, info: dict[str, Any]):
        self.client, self.id, self.info = client, info["id"], info
        self.path = f"/v1/sessions/{self.id}"
        # a session restored from a snapshot: its blocks, in the order they were saved
        self.restored_blocks = [BlockRef.parse(b) for b in info.get("blocks", [])]

    def _call(self, method: str, path: str = "", **kwargs: Any) -> Call[Any]:
        return Call(method, self.path + path, **kwargs)

    # blocks
    def block(
        self,
        text: str | None = None,
        *,
        token_ids: list[int] | None = None,
        name: str | None = None,
        priority: str | None = None,
    ) -> Call[BlockRef]:
        """A new block, holding `text` or `token_ids` if given."""
        body = _clean({"text": text, "token_ids": token_ids, "name": name, "priority": priority})
        return self._call("POST", "/blocks", json=body, parse=BlockRef.parse)

    def blocks(self, text: bool = True, token_ids: bool = False) -> Call[list[BlockRef]]:
        return self._call("GET", "/blocks", params={"text": text, "token_ids": token_ids}, parse=_blocks)

    def get_block(self, block: BlockLike, token_ids: bool = False) -> Call[BlockRef]:
        params = {"token_ids": token_ids}
        return self._call("GET", f"/blocks/{_id(block)}", params=params, parse=BlockRef.parse)

    def extend(
        self,
        block: BlockLike,
        text: str | None = None,
        *,
        token_ids: list[int] | None = None,
        image: Any = None,
        frames: Sequence[Any] | None = None,
        timestamp: float | None = None,
        view: Sequence[BlockLike] | None = None,
        priority: str | None = None,
    ) -> Call[BlockRef]:
        """Append text, token ids, an image or one frame group of a live stream (at `timestamp`
        seconds). Images and frames: encoded file bytes, a local path, a PIL image, an HxWx3 uint8
        array or a data: URL; they travel as data: URLs."""
        body = _clean(
            {
                "text": text,
                "token_ids": token_ids,
                "image": data_url(image) if image is not None else None,
                "frames": [data_url(f) for f in frames] if frames is not None else None,
                "timestamp": timestamp,
                "view": _view(view) if view else None,
                "priority": priority,
            }
        )
        return self._call("POST", f"/blocks/{_id(block)}/extend", json=body, parse=BlockRef.parse)

    def truncate(self, block: BlockLike, length: int) -> Call[BlockRef]:
        body = {"length": length}
        return self._call("POST", f"/blocks/{_id(block)}/truncate", json=body, parse=BlockRef.parse)

    def fork(self, block: BlockLike, name: str | None = None) -> Call[BlockRef]:
        body = _clean({"name": name})
        return self._call("POST", f"/blocks/{_id(block)}/fork", json=body, parse=BlockRef.parse)

    def delete_block(self, block: BlockLike) -> Call[None]:
        return self._call("DELETE", f"/blocks/{_id(block)}", parse=_nothing)

    # coroutines
    def generate(
        self,
        view: Sequence[BlockLike] | BlockLike,
        max_tokens: int = 64,
        *,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: list[str] | str | None = None,
        priority: str | None = None,
        name: str | None = None,
        **extra: Any,
    ) -> Call[dict[str, Any]]:
        """Generate into view[-1] and wait: {coroutine, text, token_ids, finish_reason, usage}."""
        params = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop)
        params.update(priority=priority, name=name, **extra)
        return self._generation(view, max_tokens, params, stream=False)

    def stream(self, view: Sequence[BlockLike] | BlockLike, max_tokens: int = 64, **params: Any) -> Call[Any]:
        """Generate into view[-1], yielding events: start, token..., end (or error); the parameters
        are `generate`'s. Stopping the iteration early cancels the generation."""
        return self._generation(view, max_tokens, params, stream=True)

    def start(
        self, view: Sequence[BlockLike] | BlockLike, max_tokens: int = 64, **params: Any
    ) -> Call[dict[str, Any]]:
        """Start a generation in the background (the parameters are `generate`'s); returns the coroutine
        (follow it with `coroutine(id)`)."""
        return self._generation(view, max_tokens, params, background=True)

    def _generation(
        self, view: Sequence[BlockLike] | BlockLike, max_tokens: int, params: dict[str, Any], **mode: bool
    ) -> Call[Any]:
        """POST /generate: `params` are the generation's fields (None leaves one to the server), `mode`
        says how it answers (`stream`, `background`)."""
        body = _clean({"view": _view(view), "max_tokens": max_tokens, **params})
        return self._call("POST", "/generate", json={**body, **mode})

    def probe(
        self,
        view: Sequence[BlockLike] | BlockLike,
        question: str | list[int],
        choices: Sequence[str] = (" yes", " no"),
        priority: str | None = None,
    ) -> Call[dict[str, float]]:
        body = _clean(
            {"view": _view(view), "question": question, "choices": list(choices), "priority": priority}
        )
        return self._call("POST", "/probe", json=body, parse=lambda data: data["probabilities"])

    def coroutines(self, status: str = "all") -> Call[list[dict[str, Any]]]:
        return self._call("GET", "/coroutines", params={"status": status}, parse=lambda data: data["data"])

    def coroutine(self, coroutine_id: str) -> Call[dict[str, Any]]:
        return self._call("GET", f"/coroutines/{coroutine_id}")

    def cancel(self, coroutine_id: str) -> Call[dict[str, Any]]:
        return self._call("POST", f"/coroutines/{coroutine_id}/cancel")

    def snapshot(self, blocks: Sequence[BlockLike] | None = None) -> Call[dict[str, Any]]:
        """Save the session's blocks (or `blocks`) on the server; returns the snapshot (its "id")."""
        body = {"blocks": [_id(b) for b in blocks]} if blocks is not None else None
        return self._call("POST", "/snapshot", json=body)

    def delete(self) -> Call[None]:
        return self._call("DELETE", parse=_nothing)


def data_url(image: Any) -> str:
    """An image as a data: URL (base64): files and bytes as they are, arrays and PIL images as PNG.
    A URL string goes as it is (the server takes only data: URLs)."""
    import base64
    import io
    from pathlib import Path

    if isinstance(image, str) and (image.startswith("data:") or "://" in image):
        return image
    if isinstance(image, (str, Path)):
        image = Path(image).read_bytes()
    if not isinstance(image, (bytes, bytearray)):
        from PIL import Image

        picture = Image.fromarray(image) if not isinstance(image, Image.Image) else image
        out = io.BytesIO()
        picture.save(out, format="PNG")
        image = out.getvalue()
    return "data:application/octet-stream;base64," + base64.b64encode(bytes(image)).decode()


# The builders each transport turns into methods that send their call; a session's `stream` is sent as a
# stream of events.
CLIENT_METHODS = "health models session restore snapshots delete_snapshot".split()
SESSION_METHODS = "block blocks get_block extend truncate fork delete_block generate start probe".split()
SESSION_METHODS += "coroutines coroutine cancel snapshot delete".split()


def _transport(wrap: Callable[[Callable[..., Call[Any]]], Callable[..., Any]]) -> Callable[[type], type]:
    """A class decorator for a transport of `ClientCalls` or `SessionCalls`: each builder becomes a
    method that sends its call, through `wrap`."""

    def install(cls: type) -> type:
        core = ClientCalls if issubclass(cls, ClientCalls) else SessionCalls
        for name in CLIENT_METHODS if core is ClientCalls else SESSION_METHODS:
            setattr(cls, name, wrap(getattr(core, name)))
        if core is SessionCalls:
            cls.stream = _stream_method(SessionCalls.stream)  # type: ignore[attr-defined]
        return cls

    return install


def _client_of(owner: Any) -> Any:
    return owner if isinstance(owner, ClientCalls) else owner.client


def _as_method(build: Callable[..., Call[Any]], method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` named and documented as `build`, its signature returning what the call parses to
    (``Call[BlockRef]`` -> ``BlockRef``), as help() and IDEs show it."""
    functools.update_wrapper(method, build)
    signature = inspect.signature(build)
    result = signature.return_annotation
    if isinstance(result, str) and result.startswith("Call[") and result.endswith("]"):
        method.__signature__ = signature.replace(return_annotation=result[5:-1])  # type: ignore[attr-defined]
    return method


def _sync_method(build: Callable[..., Call[T]]) -> Callable[..., T]:
    def method(self: Any, *args: Any, **kwargs: Any) -> T:
        return _client_of(self).send(build(self, *args, **kwargs))

    return _as_method(build, method)


def _async_method(build: Callable[..., Call[T]]) -> Callable[..., Any]:
    async def method(self: Any, *args: Any, **kwargs: Any) -> T:
        return await _client_of(self).send(build(self, *args, **kwargs))

    return _as_method(build, method)


def _stream_method(build: Callable[..., Call[Any]]) -> Callable[..., Any]:
    """`stream`, for either transport: the client's `events` iterates (sync) or async-iterates."""

    @functools.wraps(build)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self.client.events(build(self, *args, **kwargs))

    return method


# ================================================================================================ sync


@_transport(_sync_method)
class Session(SessionCalls):
    """A server session over the sync transport; each method returns its result."""

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(ClientError, httpx.HTTPError):
            self.delete()


@_transport(_sync_method)
class Client(ClientCalls):
    session_type = Session

    http: httpx.Client
    http_type = httpx.Client

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.http.request(method, path, **kwargs)
        _raise_for(response)
        return response.json()

    def send(self, call: Call[T]) -> T:
        return call.parse(self.request(call.method, call.path, **call.content))

    def events(self, call: Call[Any]) -> Iterator[dict[str, Any]]:
        """The SSE events of a streaming call; closing the iterator closes the response."""
        with self.http.stream(call.method, call.path, **call.content) as response:
            if response.status_code >= 400:
                response.read()
                _raise_for(response)
            for line in response.iter_lines():
                event = _sse_data(line)
                if event is not None:
                    yield event

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ================================================================================================ async


@_transport(_async_method)
class AsyncSession(SessionCalls):
    """A server session over the async transport; each method is a coroutine, `stream` an async
    iterator."""

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(ClientError, httpx.HTTPError):
            await self.delete()


@_transport(_async_method)
class AsyncClient(ClientCalls):
    session_type = AsyncSession

    http: httpx.AsyncClient
    http_type = httpx.AsyncClient

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self.http.request(method, path, **kwargs)
        _raise_for(response)
        return response.json()

    async def send(self, call: Call[T]) -> T:
        return call.parse(await self.request(call.method, call.path, **call.content))

    async def events(self, call: Call[Any]) -> AsyncIterator[dict[str, Any]]:
        """The SSE events of a streaming call; closing the iterator closes the response."""
        async with self.http.stream(call.method, call.path, **call.content) as response:
            if response.status_code >= 400:
                await response.aread()
                _raise_for(response)
            async for line in response.aiter_lines():
                event = _sse_data(line)
                if event is not None:
                    yield event

    async def close(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
