"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Each request prefills its prompt into a fresh block (one per prompt; n > 1 forks it), generates into
each choice's block, and releases every block when the response ends, including when the client goes
away mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request
from opentelemetry import trace

from cothink.memory.block import Block
from cothink.observability.logs import coroutine_var
from cothink.runtime.work import GenerationResult, Piece
from cothink.server.errors import ERROR_RESPONSES, APIError, from_exception
from cothink.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ModelCard,
    ModelList,
    Usage,
)
from cothink.server.streaming import EventStream, cancel_on_disconnect
from cothink.server.state import ServerState, get_state

router = APIRouter(prefix="/v1", tags=["openai"])
_STARTED = int(time.time())
_ERRORS = {k: ERROR_RESPONSES[k] for k in (400, 401, 404, 413, 503)}
_STREAM_DOC = {
    "text/event-stream": {
        "schema": {"type": "string"},
        "example": 'data: {"id": "...", "choices": [...]}\n\ndata: [DONE]\n\n',
    }
}


def sse(obj: object) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def fingerprint() -> str:
    from cothink import __version__

    return f"cothink-{__version__}"


@router.get(
    "/models",
    response_model=ModelList,
    summary="The model this server runs",
    responses={401: ERROR_RESPONSES[401]},
)
async def list_models(state: ServerState = Depends(get_state)) -> ModelList:
    return ModelList(data=[ModelCard(id=state.settings.model_name, created=_STARTED)])


@router.get(
    "/models/{model_id}",
    response_model=ModelCard,
    summary="One model",
    responses={k: ERROR_RESPONSES[k] for k in (401, 404)},
)
async def get_model(model_id: str, state: ServerState = Depends(get_state)) -> ModelCard:
    if model_id != state.settings.model_name:
        raise APIError(
            404, f"The model '{model_id}' does not exist", "invalid_request_error", "model_not_found", "model"
        )
    return ModelCard(id=model_id, created=_STARTED)


# ---------------------------------------------------------------------------------------- helpers


@dataclass
class Params:
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    banned: list[int]
    n: int


def _common_params(state: ServerState, req, max_tokens: int | None, default_max: int) -> Params:
    s = state.settings
    if req.model != s.model_name:
        raise APIError(
            404,
            f"The model '{req.model}' does not exist (this server runs '{s.model_name}')",
            "invalid_request_error",
            "model_not_found",
            "model",
        )
    max_tokens = max_tokens if max_tokens is not None else default_max
    if max_tokens > s.max_tokens_per_request:
        raise APIError(
            400,
            f"max_tokens is {max_tokens}; this server allows at most {s.max_tokens_per_request}",
            "invalid_request_error",
            "max_tokens_too_large",
            "max_tokens",
        )
    for field in ("presence_penalty", "frequency_penalty"):
        if getattr(req, field, None):
            raise APIError(
                400, f"{field} is not supported (only 0)", "invalid_request_error", "unsupported", field
            )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > s.max_stop:
        raise APIError(
            400, f"at most {s.max_stop} stop sequences", "invalid_request_error", "too_many_stop", "stop"
        )
    banned = []
    for key, bias in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(
                400,
                f"logit_bias key {key!r} is not a token id",
                "invalid_request_error",
                "invalid_value",
                "logit_bias",
            ) from None
        if bias > -100:
            raise APIError(
                400,
                "logit_bias supports only -100 (ban a token)",
                "invalid_request_error",
                "unsupported",
                "logit_bias",
            )
        banned.append(token)
    if banned:
        if min(banned) < 0:
            raise APIError(
                400, "token ids must be >= 0", "invalid_request_error", "invalid_token_id", "logit_bias"
            )
        state.check_token_ids(banned, "logit_bias")
    n = req.n or 1
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    return Params(max_tokens, temperature, top_p, req.seed, [x for x in stop if x], banned, n)


class Run:
    """The blocks and generations of one request; release() gives every block back."""

    def __init__(self, state: ServerState, request_id: str):
        self.state, self.id = state, request_id
        self.blocks: list[Block] = []
        self.gens: list = []
        self.prompt_tokens = 0
        self.span = state.tracer.start_span(
            "cothink.openai.request", attributes={"cothink.request": request_id}
        )

    async def start(self, prompts: list[list[int]], p: Params, stop_ids: set[int]) -> None:
        state = self.state
        if len(prompts) * p.n > state.settings.max_choices:
            raise APIError(
                400,
                f"prompts x n may be at most {state.settings.max_choices}",
                "invalid_request_error",
                "too_many_choices",
                "n",
            )
        self.prompt_tokens = sum(len(ids) for ids in prompts)
        self.span.set_attribute("cothink.prompt_tokens", self.prompt_tokens)
        with trace.use_span(self.span, end_on_exit=False):
            bases = [state.call(state.engine.block, f"{self.id}-p{i}") for i in range(len(prompts))]
            self.blocks.extend(bases)
            await state.wait(
                asyncio.gather(
                    *(
                        state.engine.extend(b, token_ids=ids, priority="interactive", name=self.id)
                        for b, ids in zip(bases, prompts)
                    )
                )
            )
            targets = []
            for i, base in enumerate(bases):
                forks = [state.call(state.engine.fork, base, f"{self.id}-p{i}-{j}") for j in range(1, p.n)]
                self.blocks.extend(forks)
                targets.extend([base, *forks])
            for index, block in enumerate(targets):
                seed = None if p.seed is None else p.seed + index
                gen = state.call(
                    state.engine.generate,
                    [block],
                    max_tokens=p.max_tokens,
                    temperature=p.temperature,
                    top_p=p.top_p,
                    seed=seed,
                    stop=p.stop or None,
                    stop_token_ids=sorted(stop_ids),
                    banned_token_ids=p.banned or None,
                    priority="interactive",
                    name=f"{self.id}/{index}",
                )
                self.gens.append(gen)
                state.live.add(gen)

    async def events(self) -> AsyncIterator[tuple[int, Piece | GenerationResult]]:
        """(choice index, piece or final result) from every generation, as they come."""
        if len(self.gens) == 1:
            gen = self.gens[0]
            async for piece in gen:
                yield 0, piece
            yield 0, gen.result
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen) -> None:
            try:
                async for piece in gen:
                    queue.put_nowait((i, piece))
                queue.put_nowait((i, gen.result))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, exc))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self.gens)]
        try:
            done = 0
            while done < len(tasks):
                i, event = await queue.get()
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, GenerationResult):
                    done += 1
                yield i, event
        finally:
            for t in tasks:
                t.cancel()

    def cancel(self) -> None:
        for gen in self.gens:
            gen.cancel()

    async def results(self) -> list[GenerationResult]:
        try:
            return await asyncio.gather(*(g.collect() for g in self.gens))
        except Exception as exc:
            raise from_exception(exc) from exc

    def release(self, completion_tokens: int | None = None, finish: list[str] | None = None) -> None:
        for gen in self.gens:
            gen.cancel()
            self.state.live.discard(gen)
        for block in self.blocks:
            if not block.freed:
                try:
                    self.state.engine.release(block)
                except Exception:  # already released (engine stopped)
                    pass
        self.blocks.clear()
        if completion_tokens is not None:
            self.span.set_attribute("cothink.completion_tokens", completion_tokens)
        if finish:
            self.span.set_attribute("cothink.finish_reasons", finish)
        self.span.end()


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _stop_ids(state: ServerState) -> set[int]:
    from cothink.runtime.text import stop_token_ids

    tok = state.tokenizer
    return stop_token_ids(tok) if tok is not None else set()


async def _run_or_release(run: Run, prompts: list[list[int]], params: Params, stop_ids: set[int]) -> None:
    try:
        await run.start(prompts, params, stop_ids)
    except BaseException:
        run.release()
        raise


async def _collect(run: Run, request) -> list[GenerationResult]:
    """Wait for every choice of a non-streamed request (cancelled if the client leaves), then release."""
    completion, reasons = 0, []
    try:
        async with cancel_on_disconnect(request, run.cancel):
            results = await run.results()
        completion = sum(len(r.token_ids) for r in results)
        reasons = [r.finish_reason for r in results]
    finally:
        run.release(completion, reasons)
    return results


def _stream(run: Run, chunk, include_usage: bool) -> EventStream:
    """SSE: chunk(index, text, finish_reason, first) builds each chunk; usage last; then [DONE]."""

    async def body() -> AsyncIterator[str]:
        state = run.state
        state.streams_gauge.inc()
        completion, reasons = 0, []
        try:
            for i in range(len(run.gens)):
                first = chunk(i, None, None, True)
                if first is not None:
                    yield sse(first)
            async for i, event in run.events():
                if isinstance(event, GenerationResult):
                    completion += len(event.token_ids)
                    reasons.append(event.finish_reason)
                    yield sse(chunk(i, None, event.finish_reason, False))
                elif event.text:
                    yield sse(chunk(i, event.text, None, False))
            if include_usage:
                final = chunk(0, None, None, False)
                final["choices"] = []
                final["usage"] = _usage(run.prompt_tokens, completion)
                yield sse(final)
        except Exception as exc:  # after the headers: report in-band, as OpenAI does
            yield sse(from_exception(exc).body())
        finally:
            state.streams_gauge.dec()
            run.release(completion, reasons)
        yield "data: [DONE]\n\n"

    return EventStream(body(), on_disconnect=run.cancel)


# ---------------------------------------------------------------------------------------- completions


def _prompts(state: ServerState, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt is empty", "invalid_request_error", "empty_input", "prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            if state.tokenizer is None:
                raise APIError(
                    400,
                    "this model has no tokenizer: send token ids",
                    "invalid_request_error",
                    "no_tokenizer",
                    "prompt",
                )
            ids = list(state.tokenizer.encode(item, add_special_tokens=True))
        else:
            ids = list(item)
            state.check_token_ids(ids, "prompt")
        if not ids:
            raise APIError(400, "prompt is empty", "invalid_request_error", "empty_input", "prompt")
        out.append(ids)
    return out


@router.post(
    "/completions",
    response_model=Completion,
    summary="Text completion (OpenAI-compatible)",
    responses={**_ERRORS, 200: {"content": _STREAM_DOC, "description": "JSON, or SSE when stream"}},
)
async def completions(request: Request, req: CompletionRequest, state: ServerState = Depends(get_state)):
    params = _common_params(state, req, req.max_tokens, state.settings.default_completion_max_tokens)
    if req.suffix:
        raise APIError(400, "suffix is not supported", "invalid_request_error", "unsupported", "suffix")
    if req.logprobs is not None:
        raise APIError(400, "logprobs is not supported", "invalid_request_error", "unsupported", "logprobs")
    if req.best_of is not None and req.best_of > 1:
        raise APIError(400, "best_of is not supported", "invalid_request_error", "unsupported", "best_of")
    prompts = _prompts(state, req.prompt)
    request_id = f"cmpl-{secrets.token_urlsafe(18)}"
    coroutine_var.set(request_id)
    created, model = int(time.time()), state.settings.model_name
    run = Run(state, request_id)
    await _run_or_release(run, prompts, params, _stop_ids(state))
    echoes = [
        state.decode(ids, skip_special=True) if req.echo else "" for ids in prompts for _ in range(params.n)
    ]

    if req.stream:

        def chunk(i, text, finish, first):
            if first:
                return (
                    None
                    if not echoes[i]
                    else _completion_chunk(request_id, created, model, i, echoes[i], None)
                )
            return _completion_chunk(request_id, created, model, i, text or "", finish)

        include = bool(req.stream_options and req.stream_options.include_usage)
        return _stream(run, chunk, include)
    results = await _collect(run, request)
    return Completion(
        id=request_id,
        created=created,
        model=model,
        system_fingerprint=fingerprint(),
        choices=[
            CompletionChoice(index=i, text=echoes[i] + r.text, finish_reason=r.finish_reason)
            for i, r in enumerate(results)
        ],
        usage=Usage(**_usage(run.prompt_tokens, sum(len(r.token_ids) for r in results))),
    )


def _completion_chunk(request_id, created, model, index, text, finish) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint(),
        "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}],
    }


# ---------------------------------------------------------------------------------------- chat


def _chat_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    tok = state.tokenizer
    if tok is None:
        raise APIError(
            400,
            "this model has no tokenizer, so no chat template",
            "invalid_request_error",
            "no_tokenizer",
            "messages",
        )
    messages = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            parts = []
            for part in m.content:
                if part.type != "text":
                    raise APIError(
                        400,
                        f"content parts of type {part.type!r} are not supported",
                        "invalid_request_error",
                        "unsupported",
                        f"messages.{i}.content",
                    )
                parts.append(part.text or "")
            content = "".join(parts)
        else:
            content = m.content or ""
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    if getattr(tok, "chat_template", None):
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja raises for conversations the template refuses
            raise APIError(
                400,
                f"the chat template rejected the messages: {exc}",
                "invalid_request_error",
                "invalid_messages",
                "messages",
            ) from None
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    ids = list(tok.encode(text, add_special_tokens=False))
    if not ids:
        raise APIError(400, "the conversation is empty", "invalid_request_error", "empty_input", "messages")
    return ids


@router.post(
    "/chat/completions",
    response_model=ChatCompletion,
    summary="Chat completion (OpenAI-compatible)",
    responses={**_ERRORS, 200: {"content": _STREAM_DOC, "description": "JSON, or SSE when stream"}},
)
async def chat_completions(
    request: Request, req: ChatCompletionRequest, state: ServerState = Depends(get_state)
):
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = _common_params(state, req, max_tokens, state.settings.default_chat_max_tokens)
    if req.logprobs:
        raise APIError(400, "logprobs is not supported", "invalid_request_error", "unsupported", "logprobs")
    if req.tools:
        raise APIError(400, "tools are not supported", "invalid_request_error", "unsupported", "tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise APIError(
            400,
            "only response_format type 'text' is supported",
            "invalid_request_error",
            "unsupported",
            "response_format",
        )
    prompt = _chat_prompt(state, req)
    request_id = f"chatcmpl-{secrets.token_urlsafe(18)}"
    coroutine_var.set(request_id)
    created, model = int(time.time()), state.settings.model_name
    run = Run(state, request_id)
    await _run_or_release(run, [prompt], params, _stop_ids(state))
    include = bool(req.stream_options and req.stream_options.include_usage)

    if req.stream:

        def chunk(i, text, finish, first):
            if first:
                delta = {"role": "assistant", "content": ""}
            elif text is not None:
                delta = {"content": text}
            else:
                delta = {}
            out = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "system_fingerprint": fingerprint(),
                "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }
            if include:
                out["usage"] = None
            return out

        return _stream(run, chunk, include)
    results = await _collect(run, request)
    return ChatCompletion(
        id=request_id,
        created=created,
        model=model,
        system_fingerprint=fingerprint(),
        choices=[
            ChatChoice(index=i, message=AssistantMessage(content=r.text), finish_reason=r.finish_reason)
            for i, r in enumerate(results)
        ],
        usage=Usage(**_usage(run.prompt_tokens, sum(len(r.token_ids) for r in results))),
    )
