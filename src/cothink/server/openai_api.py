"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Each request prefills its prompt into a fresh block (one per prompt; n > 1 forks it), generates into
each choice's block, and releases every block when the response ends, including when the client goes
away mid-stream.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from dataclasses import field as dataclass_field

from fastapi import APIRouter, Depends, Request
from opentelemetry import trace

from cothink.memory.block import Block
from cothink.observability.logs import coroutine_var
from cothink.runtime.engine import GenerationResult, Piece
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
from cothink.server.openai_features import (
    Structured,
    chat_logprobs,
    completion_logprobs,
    parse_tool_call,
    render_messages,
    structured_for,
    template_has_tools,
    validate_tools,
)
from cothink.server.quota import Hold
from cothink.server.streaming import EventStream, abort_on_disconnect, cancel_on_disconnect, sse
from cothink.server.state import ServerState, get_state, principal
from cothink.server.vision_parts import PromptImages

router = APIRouter(prefix="/v1", tags=["openai"])
_STARTED = int(time.time())
_ERRORS = {k: ERROR_RESPONSES[k] for k in (400, 401, 404, 413, 503)}
_STREAM_DOC = {
    "text/event-stream": {
        "schema": {"type": "string"},
        "example": 'data: {"id": "...", "choices": [...]}\n\ndata: [DONE]\n\n',
    }
}


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
    logprobs: int | None = None  # tokens' log-probabilities with this many alternatives
    structured: Structured = dataclass_field(default_factory=Structured)


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
        banned.append(token)  # checked by the engine (its `banned_token_ids`)
    n = req.n or 1
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    return Params(max_tokens, temperature, top_p, req.seed, [x for x in stop if x], banned, n)


@dataclass
class Outcome:
    result: GenerationResult
    logprobs: list  # TokenLogprob per output token, when asked for


class Run:
    """The blocks and generations of one request; release() gives every block back."""

    def __init__(self, state: ServerState, request_id: str, account: str, images: PromptImages | None = None):
        self.state, self.id, self.account = state, request_id, account
        self.images = images  # the prompt's images (server/vision_parts.py); None: text only
        self.blocks: list[Block] = []
        self.gens: list = []
        self.prompt_tokens = 0
        self.cached_tokens = 0  # prompt tokens reused from the prefix cache
        self.hold: Hold | None = None
        self.structured = Structured()  # how each choice's output is constrained and checked
        self.span = state.tracer.start_span(
            "cothink.openai.request", attributes={"cothink.request": request_id}
        )

    @property
    def prompt_field(self) -> str:
        """The request field that holds the prompt."""
        return "messages" if self.id.startswith("chatcmpl") else "prompt"

    async def start(self, prompts: list[list[int]], p: Params, stop_ids: set[int]) -> None:
        state = self.state
        self.structured = p.structured
        if len(prompts) * p.n > state.settings.max_choices:
            raise APIError(
                400,
                f"prompts x n may be at most {state.settings.max_choices}",
                "invalid_request_error",
                "too_many_choices",
                "n",
            )
        param = self.prompt_field
        for ids in prompts:
            if state.max_context is not None and len(ids) > state.max_context:
                state.check_context(len(ids), 0, param)
            state.check_context(len(ids), p.max_tokens)
        self.prompt_tokens = sum(len(ids) for ids in prompts)
        self.span.set_attribute("cothink.prompt_tokens", self.prompt_tokens)
        # every prompt and choice is admitted as one unit, or the request is refused before any prefill
        g = state.ledger.geometry
        pages = sum(
            g.pages_for(len(ids) + p.max_tokens)
            + (p.n - 1) * (g.pages_for(len(ids) + p.max_tokens) - len(ids) // g.page_size)
            for ids in prompts
        )
        what = (
            f"{len(prompts)} prompt(s) of {self.prompt_tokens} tokens x n={p.n} "
            f"with max_tokens={p.max_tokens}"
        )
        self.hold = state.ledger.admit(self.account, pages, what)
        state.own(self.id, self.account)
        with trace.use_span(self.span, end_on_exit=False):
            cache = state.prefix_cache
            cache.make_room(pages)  # cached prefixes give their pages back before a request waits
            bases, cached = [], []
            for i, ids in enumerate(prompts):
                if self.images is not None:  # placeholder ids do not name pixels: no prefix reuse
                    base, hit = state.call(state.engine.block, f"{self.id}-p{i}"), 0
                else:
                    base, hit = state.call(cache.start, self.account, ids, f"{self.id}-p{i}")
                bases.append(base)
                cached.append(hit)
                self.blocks.append(base)
            self.cached_tokens = sum(cached)
            await state.wait(
                asyncio.gather(
                    *(
                        self.images.write(b, ids, self.id) if self.images is not None else
                        state.engine.extend(b, token_ids=ids[hit:], priority="interactive", name=self.id)
                        for b, ids, hit in zip(bases, prompts, cached)
                    )
                )
            )
            for base, ids in zip(bases, prompts):
                if self.images is None:
                    state.call(cache.insert, self.account, ids, base)
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
                    logprobs=p.logprobs,
                    constraint=p.structured.make_constraint() if p.structured.make_constraint else None,
                )
                self.gens.append(gen)
                state.live.add(gen)
                state.own(gen.name, self.account)

    async def events(self) -> AsyncIterator[tuple[int, Piece | GenerationResult]]:
        """(choice index, piece or final result) from every generation, as they come."""
        if len(self.gens) == 1:
            gen = self.gens[0]
            async for piece in gen:
                yield 0, piece
            self.structured.check(gen.result)
            yield 0, gen.result
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen) -> None:
            try:
                async for piece in gen:
                    queue.put_nowait((i, piece))
                self.structured.check(gen.result)
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

    async def results(self) -> list[Outcome]:
        async def one(gen) -> Outcome:
            logprobs = []
            async for piece in gen:
                logprobs.extend(piece.logprobs or ())
            self.structured.check(gen.result)
            return Outcome(gen.result, logprobs)

        try:
            return await asyncio.gather(*(one(g) for g in self.gens))
        except Exception as exc:
            raise from_exception(exc) from exc

    def release(self, completion_tokens: int | None = None, finish: list[str] | None = None) -> None:
        if self.hold is not None:
            self.hold.release()
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


def _usage(prompt: int, completion: int, cached: int = 0) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _stop_ids(state: ServerState) -> set[int]:
    from cothink.models.text import stop_token_ids

    tok = state.tokenizer
    return stop_token_ids(tok) if tok is not None else set()


async def _run_or_release(
    request: Request, run: Run, prompts: list[list[int]], params: Params, stop_ids: set[int]
) -> None:
    """Admit and prefill the request; a client leaving during the prefill stops it within a step."""
    try:
        async with abort_on_disconnect(request):
            await run.start(prompts, params, stop_ids)
    except BaseException as exc:
        run.release()
        if isinstance(exc, APIError):  # the engine checked its own parameters: name the request's fields
            fields = {"token_ids": run.prompt_field, "banned_token_ids": "logit_bias"}
            exc.param = fields.get(exc.param, exc.param)
        raise


async def _collect(run: Run, request) -> list[Outcome]:
    """Wait for every choice of a non-streamed request (cancelled if the client leaves), then release."""
    completion, reasons = 0, []
    try:
        async with cancel_on_disconnect(request, run.cancel):
            results = await run.results()
        completion = sum(len(o.result.token_ids) for o in results)
        reasons = [o.result.finish_reason for o in results]
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
                    out = chunk(i, None, event.finish_reason, False)
                elif event.text or event.logprobs:
                    out = chunk(i, event.text, None, False, event.logprobs)
                else:
                    out = None
                if out is not None:
                    yield sse(out)
            if include_usage:
                final = chunk(0, None, None, False)
                final.pop("usage", None)
                final["choices"] = []
                final["usage"] = _usage(run.prompt_tokens, completion, run.cached_tokens)
                yield sse(final)
        except Exception as exc:  # after the headers: report in-band, as OpenAI does
            yield sse(from_exception(exc).body())
        finally:
            state.streams_gauge.dec()
            run.release(completion, reasons)
        yield "data: [DONE]\n\n"

    return EventStream(body(), on_disconnect=run.cancel)


# ---------------------------------------------------------------------------------------- completions


async def _prompts(state: ServerState, prompt) -> list[list[int]]:
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
            ids = await state.encode(item, "prompt", special=True)
        else:
            ids = list(item)  # checked by the engine
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
    params.logprobs = req.logprobs
    if req.best_of is not None and req.best_of > 1:
        raise APIError(400, "best_of is not supported", "invalid_request_error", "unsupported", "best_of")
    prompts = await _prompts(state, req.prompt)
    request_id = f"cmpl-{secrets.token_urlsafe(18)}"
    coroutine_var.set(request_id)
    created, model = int(time.time()), state.settings.model_name
    run = Run(state, request_id, principal(request))
    await _run_or_release(request, run, prompts, params, _stop_ids(state))
    echoes = [
        state.decode(ids, skip_special=True) if req.echo else "" for ids in prompts for _ in range(params.n)
    ]

    if req.stream:

        def chunk(i, text, finish, first, logprobs=None):
            if first:
                return (
                    None
                    if not echoes[i]
                    else _completion_chunk(request_id, created, model, i, echoes[i], None)
                )
            out = _completion_chunk(request_id, created, model, i, text or "", finish)
            if logprobs:
                out["choices"][0]["logprobs"] = completion_logprobs(state, logprobs)
            if include:
                out["usage"] = None  # as OpenAI: null on every chunk but the last
            return out

        include = bool(req.stream_options and req.stream_options.include_usage)
        return _stream(run, chunk, include)
    results = await _collect(run, request)
    return Completion(
        id=request_id,
        created=created,
        model=model,
        system_fingerprint=fingerprint(),
        choices=[
            CompletionChoice(
                index=i,
                text=echoes[i] + o.result.text,
                finish_reason=o.result.finish_reason,
                logprobs=completion_logprobs(state, o.logprobs, len(echoes[i]))
                if params.logprobs is not None
                else None,
            )
            for i, o in enumerate(results)
        ],
        usage=Usage(
            **_usage(run.prompt_tokens, sum(len(o.result.token_ids) for o in results), run.cached_tokens)
        ),
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


async def _chat_prompt(
    state: ServerState, req: ChatCompletionRequest, tools: list[dict] | None = None
) -> tuple[list[int], PromptImages | None]:
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
    images: PromptImages | None = None
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            parts = []
            for j, part in enumerate(m.content):
                if part.type == "image_url":  # a marker in the text; the image is written in its place
                    images = images or PromptImages(state.engine)
                    parts.append(images.add(part.image_url, f"messages.{i}.content.{j}"))
                    continue
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
        message = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    native = template_has_tools(tok)
    messages = render_messages(messages, tools or [], native)
    extra = {"tools": tools} if tools and native else {}
    size = sum(len(m["content"]) for m in messages)
    state.check_text_size("".join(m["content"] for m in messages), "messages")
    if getattr(tok, "chat_template", None):
        try:
            text = await state.off_loop(
                size, tok.apply_chat_template, messages, add_generation_prompt=True, tokenize=False, **extra
            )
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
    ids = await images.expand(state, text, "messages") if images else await state.encode(text, "messages")
    if not ids:
        raise APIError(400, "the conversation is empty", "invalid_request_error", "empty_input", "messages")
    return ids, images


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
        params.logprobs = req.top_logprobs or 0
    top = req.top_logprobs or 0
    tools = validate_tools(req.tools)
    params.structured = structured_for(state, req.response_format, tools, req.tool_choice)
    calls = params.structured.tool_calls
    prompt, images = await _chat_prompt(state, req, tools if req.tool_choice != "none" else None)
    request_id = f"chatcmpl-{secrets.token_urlsafe(18)}"
    coroutine_var.set(request_id)
    created, model = int(time.time()), state.settings.model_name
    run = Run(state, request_id, principal(request), images)
    await _run_or_release(request, run, [prompt], params, _stop_ids(state))
    include = bool(req.stream_options and req.stream_options.include_usage)

    if req.stream:
        held: dict[int, str] = {}  # with tools, a choice's text is held until it is known to be a call

        def chunk(i, text, finish, first, logprobs=None):
            if first:
                delta = {"role": "assistant", "content": ""}
            elif calls != "never" and finish is None:
                held[i] = held.get(i, "") + (text or "")
                return None
            elif calls != "never":
                call = parse_tool_call(held.get(i, ""), calls)
                delta = {"tool_calls": [{"index": 0, **call}]} if call else {"content": held.get(i, "")}
                finish = "tool_calls" if call else finish
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
                "choices": [
                    {
                        "index": i,
                        "delta": delta,
                        "logprobs": chat_logprobs(state, logprobs, top) if logprobs else None,
                        "finish_reason": finish,
                    }
                ],
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
            _chat_choice(state, i, o, calls, top if params.logprobs is not None else None)
            for i, o in enumerate(results)
        ],
        usage=Usage(
            **_usage(run.prompt_tokens, sum(len(o.result.token_ids) for o in results), run.cached_tokens)
        ),
    )


def _chat_choice(state: ServerState, index: int, outcome: Outcome, calls: str, top: int | None) -> ChatChoice:
    result = outcome.result
    call = parse_tool_call(result.text, calls)
    if call:
        message = AssistantMessage(content=None, tool_calls=[call])
    else:
        message = AssistantMessage(content=result.text)
    return ChatChoice(
        index=index,
        message=message,
        finish_reason="tool_calls" if call else result.finish_reason,
        logprobs=chat_logprobs(state, outcome.logprobs, top) if top is not None else None,
    )
