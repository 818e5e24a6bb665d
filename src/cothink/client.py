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
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import httpx

__all__ = ["AsyncClient", "AsyncSession", "BlockRef", "Client", "ClientError", "Session"]


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
    if line.startswith("data: "):
        data = line[6:]
        if data != "[DONE]":
            return json.loads(data)
    return None


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _gen_body(
    view, max_tokens, temperature, top_p, top_k, seed, stop, priority, name, extra
) -> dict[str, Any]:
    return _clean(
        {
            "view": _view(view),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "seed": seed,
            "stop": stop,
            "priority": priority,
            "name": name,
            **extra,
        }
    )


# ================================================================================================ sync


class Client:
    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        timeout: float | None = 120.0,
        http: httpx.Client | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.http = http or httpx.Client(base_url=self.base_url, headers=_headers(api_key), timeout=timeout)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.http.request(method, path, **kwargs)
        _raise_for(response)
        return response.json()

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/health")

    def models(self) -> list[str]:
        return [m["id"] for m in self.request("GET", "/v1/models")["data"]]

    def session(self, name: str | None = None) -> Session:
        return Session(self, self.request("POST", "/v1/sessions", json=_clean({"name": name})))

    def restore(self, snapshot: str, name: str | None = None) -> Session:
        """A new session from a snapshot (`Session.snapshot()`); its blocks keep their ids
        (`session.restored_blocks`)."""
        body = _clean({"snapshot": snapshot, "name": name})
        return Session(self, self.request("POST", "/v1/sessions/restore", json=body))

    def delete_snapshot(self, snapshot: str) -> None:
        self.request("DELETE", f"/v1/sessions/snapshots/{snapshot}")

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Session:
    """A server session: blocks and coroutines private to it. Delete it (or use `with`) when done."""

    def __init__(self, client: Client, info: dict[str, Any]):
        self.client, self.id, self.info = client, info["id"], info
        self.path = f"/v1/sessions/{self.id}"
        # a session restored from a snapshot: its blocks, in the order they were saved
        self.restored_blocks = [BlockRef.parse(b) for b in info.get("blocks", [])]

    def _call(self, method: str, path: str = "", **kwargs: Any) -> Any:
        return self.client.request(method, self.path + path, **kwargs)

    # blocks
    def block(
        self,
        text: str | None = None,
        *,
        token_ids: list[int] | None = None,
        name: str | None = None,
        priority: str | None = None,
    ) -> BlockRef:
        """A new block, holding `text` or `token_ids` if given."""
        body = _clean({"text": text, "token_ids": token_ids, "name": name, "priority": priority})
        return BlockRef.parse(self._call("POST", "/blocks", json=body))

    def blocks(self, text: bool = True, token_ids: bool = False) -> list[BlockRef]:
        data = self._call("GET", "/blocks", params={"text": text, "token_ids": token_ids})["data"]
        return [BlockRef.parse(b) for b in data]

    def get_block(self, block: BlockLike, token_ids: bool = False) -> BlockRef:
        return BlockRef.parse(self._call("GET", f"/blocks/{_id(block)}", params={"token_ids": token_ids}))

    def extend(
        self,
        block: BlockLike,
        text: str | None = None,
        *,
        token_ids: list[int] | None = None,
        view: Sequence[BlockLike] | None = None,
        priority: str | None = None,
    ) -> BlockRef:
        body = _clean(
            {
                "text": text,
                "token_ids": token_ids,
                "view": _view(view) if view else None,
                "priority": priority,
            }
        )
        return BlockRef.parse(self._call("POST", f"/blocks/{_id(block)}/extend", json=body))

    def truncate(self, block: BlockLike, length: int) -> BlockRef:
        return BlockRef.parse(self._call("POST", f"/blocks/{_id(block)}/truncate", json={"length": length}))

    def fork(self, block: BlockLike, name: str | None = None) -> BlockRef:
        return BlockRef.parse(self._call("POST", f"/blocks/{_id(block)}/fork", json=_clean({"name": name})))

    def delete_block(self, block: BlockLike) -> None:
        self._call("DELETE", f"/blocks/{_id(block)}")

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
    ) -> dict[str, Any]:
        """Generate into view[-1] and wait: {coroutine, text, token_ids, finish_reason, usage}."""
        body = _gen_body(view, max_tokens, temperature, top_p, top_k, seed, stop, priority, name, extra)
        return self._call("POST", "/generate", json={**body, "stream": False})

    def stream(
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
    ) -> Iterator[dict[str, Any]]:
        """Generate into view[-1], yielding events: start, token..., end (or error).
        Stopping the iteration early cancels the generation."""
        body = _gen_body(view, max_tokens, temperature, top_p, top_k, seed, stop, priority, name, extra)
        with self.client.http.stream(
            "POST", self.path + "/generate", json={**body, "stream": True}
        ) as response:
            if response.status_code >= 400:
                response.read()
                _raise_for(response)
            for line in response.iter_lines():
                event = _sse_data(line)
                if event is not None:
                    yield event

    def start(
        self, view: Sequence[BlockLike] | BlockLike, max_tokens: int = 64, **params: Any
    ) -> dict[str, Any]:
        """Start a generation in the background; returns the coroutine (follow it with `coroutine(id)`)."""
        body = _gen_body(
            view,
            max_tokens,
            params.pop("temperature", None),
            params.pop("top_p", None),
            params.pop("top_k", None),
            params.pop("seed", None),
            params.pop("stop", None),
            params.pop("priority", None),
            params.pop("name", None),
            params,
        )
        return self._call("POST", "/generate", json={**body, "background": True})

    def probe(
        self,
        view: Sequence[BlockLike] | BlockLike,
        question: str | list[int],
        choices: Sequence[str] = (" yes", " no"),
        priority: str | None = None,
    ) -> dict[str, float]:
        body = _clean(
            {"view": _view(view), "question": question, "choices": list(choices), "priority": priority}
        )
        return self._call("POST", "/probe", json=body)["probabilities"]

    def coroutines(self, status: str = "all") -> list[dict[str, Any]]:
        return self._call("GET", "/coroutines", params={"status": status})["data"]

    def coroutine(self, coroutine_id: str) -> dict[str, Any]:
        return self._call("GET", f"/coroutines/{coroutine_id}")

    def cancel(self, coroutine_id: str) -> dict[str, Any]:
        return self._call("POST", f"/coroutines/{coroutine_id}/cancel")

    def snapshot(self, blocks: Sequence[BlockLike] | None = None) -> dict[str, Any]:
        """Save the session's blocks (or `blocks`) on the server; returns the snapshot (its "id")."""
        body = {"blocks": [_id(b) for b in blocks]} if blocks is not None else None
        return self._call("POST", "/snapshot", json=body)

    def delete(self) -> None:
        self._call("DELETE")

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.delete()
        except (ClientError, httpx.HTTPError):
            pass


# ================================================================================================ async


class AsyncClient:
    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        timeout: float | None = 120.0,
        http: httpx.AsyncClient | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.http = http or httpx.AsyncClient(
            base_url=self.base_url, headers=_headers(api_key), timeout=timeout
        )

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self.http.request(method, path, **kwargs)
        _raise_for(response)
        return response.json()

    async def health(self) -> dict[str, Any]:
        return await self.request("GET", "/health")

    async def models(self) -> list[str]:
        return [m["id"] for m in (await self.request("GET", "/v1/models"))["data"]]

    async def session(self, name: str | None = None) -> AsyncSession:
        return AsyncSession(self, await self.request("POST", "/v1/sessions", json=_clean({"name": name})))

    async def restore(self, snapshot: str, name: str | None = None) -> AsyncSession:
        body = _clean({"snapshot": snapshot, "name": name})
        return AsyncSession(self, await self.request("POST", "/v1/sessions/restore", json=body))

    async def delete_snapshot(self, snapshot: str) -> None:
        await self.request("DELETE", f"/v1/sessions/snapshots/{snapshot}")

    async def close(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncSession:
    def __init__(self, client: AsyncClient, info: dict[str, Any]):
        self.client, self.id, self.info = client, info["id"], info
        self.path = f"/v1/sessions/{self.id}"
        self.restored_blocks = [BlockRef.parse(b) for b in info.get("blocks", [])]

    async def _call(self, method: str, path: str = "", **kwargs: Any) -> Any:
        return await self.client.request(method, self.path + path, **kwargs)

    async def block(
        self,
        text: str | None = None,
        *,
        token_ids: list[int] | None = None,
        name: str | None = None,
        priority: str | None = None,
    ) -> BlockRef:
        body = _clean({"text": text, "token_ids": token_ids, "name": name, "priority": priority})
        return BlockRef.parse(await self._call("POST", "/blocks", json=body))

    async def blocks(self, text: bool = True, token_ids: bool = False) -> list[BlockRef]:
        data = (await self._call("GET", "/blocks", params={"text": text, "token_ids": token_ids}))["data"]
        return [BlockRef.parse(b) for b in data]

    async def get_block(self, block: BlockLike, token_ids: bool = False) -> BlockRef:
        return BlockRef.parse(
            await self._call("GET", f"/blocks/{_id(block)}", params={"token_ids": token_ids})
        )

    async def extend(
        self,
        block: BlockLike,
        text: str | None = None,
        *,
        token_ids: list[int] | None = None,
        view: Sequence[BlockLike] | None = None,
        priority: str | None = None,
    ) -> BlockRef:
        body = _clean(
            {
                "text": text,
                "token_ids": token_ids,
                "view": _view(view) if view else None,
                "priority": priority,
            }
        )
        return BlockRef.parse(await self._call("POST", f"/blocks/{_id(block)}/extend", json=body))

    async def truncate(self, block: BlockLike, length: int) -> BlockRef:
        return BlockRef.parse(
            await self._call("POST", f"/blocks/{_id(block)}/truncate", json={"length": length})
        )

    async def fork(self, block: BlockLike, name: str | None = None) -> BlockRef:
        return BlockRef.parse(
            await self._call("POST", f"/blocks/{_id(block)}/fork", json=_clean({"name": name}))
        )

    async def delete_block(self, block: BlockLike) -> None:
        await self._call("DELETE", f"/blocks/{_id(block)}")

    async def generate(
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
    ) -> dict[str, Any]:
        body = _gen_body(view, max_tokens, temperature, top_p, top_k, seed, stop, priority, name, extra)
        return await self._call("POST", "/generate", json={**body, "stream": False})

    async def stream(
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
    ) -> AsyncIterator[dict[str, Any]]:
        body = _gen_body(view, max_tokens, temperature, top_p, top_k, seed, stop, priority, name, extra)
        async with self.client.http.stream(
            "POST", self.path + "/generate", json={**body, "stream": True}
        ) as response:
            if response.status_code >= 400:
                await response.aread()
                _raise_for(response)
            async for line in response.aiter_lines():
                event = _sse_data(line)
                if event is not None:
                    yield event

    async def start(
        self, view: Sequence[BlockLike] | BlockLike, max_tokens: int = 64, **params: Any
    ) -> dict[str, Any]:
        body = _gen_body(
            view,
            max_tokens,
            params.pop("temperature", None),
            params.pop("top_p", None),
            params.pop("top_k", None),
            params.pop("seed", None),
            params.pop("stop", None),
            params.pop("priority", None),
            params.pop("name", None),
            params,
        )
        return await self._call("POST", "/generate", json={**body, "background": True})

    async def probe(
        self,
        view: Sequence[BlockLike] | BlockLike,
        question: str | list[int],
        choices: Sequence[str] = (" yes", " no"),
        priority: str | None = None,
    ) -> dict[str, float]:
        body = _clean(
            {"view": _view(view), "question": question, "choices": list(choices), "priority": priority}
        )
        return (await self._call("POST", "/probe", json=body))["probabilities"]

    async def coroutines(self, status: str = "all") -> list[dict[str, Any]]:
        return (await self._call("GET", "/coroutines", params={"status": status}))["data"]

    async def coroutine(self, coroutine_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/coroutines/{coroutine_id}")

    async def cancel(self, coroutine_id: str) -> dict[str, Any]:
        return await self._call("POST", f"/coroutines/{coroutine_id}/cancel")

    async def snapshot(self, blocks: Sequence[BlockLike] | None = None) -> dict[str, Any]:
        body = {"blocks": [_id(b) for b in blocks]} if blocks is not None else None
        return await self._call("POST", "/snapshot", json=body)

    async def delete(self) -> None:
        await self._call("DELETE")

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.delete()
        except (ClientError, httpx.HTTPError):
            pass
